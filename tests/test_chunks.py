"""Chunk-GRPO: chunk ratios, boundaries and the weighted sampler, against hand computation (spec §2)."""

import math
from pathlib import Path

import pytest
import torch
import yaml

from flowrl import chunks as ch
from flowrl.config import load_config
from flowrl.errors import ConfigError
from flowrl.losses import ppo_clip_loss

ROOT = Path(__file__).resolve().parent.parent


def test_chunk_size_one_is_the_step_level_loss():
    logp = torch.tensor([-1.0, -0.5, -2.0, 0.3])
    old = torch.tensor([-1.001, -0.5, -1.99, 0.3004])
    adv = torch.tensor([1.0, -2.0, 0.5, 1.5])
    log_ratio = ch.chunk_log_ratio(logp, old, torch.arange(4), 4)
    chunk_loss, chunk_ratio = ppo_clip_loss(log_ratio, torch.zeros(4), adv, 2e-3)
    step_loss, step_ratio = ppo_clip_loss(logp, old, adv, 2e-3)
    assert torch.allclose(chunk_loss, step_loss) and torch.allclose(chunk_ratio, step_ratio)


def test_one_chunk_is_the_sequence_level_ratio():
    logp = torch.tensor([-1.0, -0.5, -2.0, 0.3])
    old = torch.tensor([-1.2, -0.4, -2.0, 0.1])
    (log_ratio,) = ch.chunk_log_ratio(logp, old, torch.zeros(4, dtype=torch.long), 1)
    assert math.exp(log_ratio) == pytest.approx(math.prod(math.exp(a - b) for a, b in zip(logp.tolist(), old.tolist())) ** 0.25)


def test_boundaries():
    assert ch.fixed_chunks([2, 3, 4, 7], 16) == [2, 3, 4, 7]
    with pytest.raises(ConfigError, match="sum to the 15"):
        ch.fixed_chunks([2, 3, 4, 7], 15)
    assert ch.uniform_chunks(4, 16) == [4, 4, 4, 4] and ch.uniform_chunks(5, 16) == [5, 5, 5, 1]
    # falling then rising: first differences split 6 | 3; the left half's second differences all agree -> midpoint
    curve = [10, 6, 3, 1, 0.5, 0.4, 0.6, 1.0, 2.0]
    assert ch.adaptive_chunks(curve, min_size=2) == [3, 3, 3]
    assert ch.adaptive_chunks([5.0, 4, 3, 2, 3, 4, 5, 6], min_size=2) == [2, 2, 2, 2]
    assert ch.adaptive_chunks([1.0, 2.0], min_size=2) == [2]


def test_weighted_sampler_probabilities_by_hand():
    curve = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    w = ch.chunk_weights(curve, [2, 4])  # chunk means 1.5 and 4.5
    assert w.tolist() == pytest.approx([0.25, 0.75])
    soft = ch.chunk_weights(curve, [2, 4], "softmax")
    assert soft.tolist() == pytest.approx([1 / (1 + math.exp(3)), math.exp(3) / (1 + math.exp(3))])
    gen = torch.Generator().manual_seed(0)
    picks = [ch.select_chunks(2, 1, gen, w)[0] for _ in range(4000)]
    assert sum(picks) / 4000 == pytest.approx(0.75, abs=0.025)
    assert ch.select_chunks(4, 4, gen) == [0, 1, 2, 3]


def test_relative_l1_by_hand():
    path = torch.tensor([[2.0, -2.0], [1.0, -1.0], [1.0, 0.0]])
    assert ch.relative_l1(path).tolist() == pytest.approx([1.0 / 2.0, 0.5 / 1.0])


def test_chunk_update_with_unit_chunks_equals_step_level_update(tmp_path):
    """Same tree, same advantages: chunk_grpo with 1-step chunks (all trained) makes exactly the step-level update."""
    from flowrl.algorithms import make_algorithm
    from flowrl.engine import rollout
    from flowrl.objectives import UpdateBatch
    from flowrl.optimise import optimise
    from flowrl.trainer import Trainer

    common = [f"log.output_dir={tmp_path}", "log.progress=false", "sampler.num_steps=5", "train.num_minibatches=1",
              "train.prompts_per_iter=1", "algorithm.group_size=4", "algorithm.timestep_fraction=1.0"]
    chunk_cfg = load_config(ROOT / "configs/tiny_chunk_grpo.yaml", [*common, "algorithm.mode=uniform",
                                                                     "algorithm.size=1", "log.run_name=c"])
    # the same file with its algorithm section swapped: each algorithm accepts only its own options
    data = yaml.safe_load((ROOT / "configs/tiny_chunk_grpo.yaml").read_text())
    data["algorithm"] = {"name": "dance_grpo", "shared_noise": True, "timestep_selection": "first"}
    (tmp_path / "step.yaml").write_text(yaml.safe_dump(data))
    step_cfg = load_config(tmp_path / "step.yaml", [*common, "log.run_name=s"])
    grads = []
    for cfg in (chunk_cfg, step_cfg):
        trainer = Trainer(cfg)
        # compare gradients, not parameters: Adam's first step is ~lr * sign(g), which turns float noise in
        # near-zero gradient entries into lr-sized differences
        trainer.policy.optimizer.step = lambda t=trainer: grads.append(torch.cat([p.grad.flatten() for p in t.policy.params]))
        plan = make_algorithm(cfg).plan(0, sigmas=trainer.sigmas)
        cond = trainer.adapter.encode_prompts(["a cat"])
        tree = rollout(trainer.adapter, cond, plan, trainer.sigmas, trainer.latent_shape, kernel="flow_grpo",
                       noise_level=0.7, generator=torch.Generator().manual_seed(0))
        rewards = tree.leaves.mean(dim=(1, 2, 3))
        adv, keep, _ = make_algorithm(cfg).advantages(tree, rewards, 0)
        masks = make_algorithm(cfg).select_edges(tree, torch.Generator())
        stats = optimise(trainer.objective, UpdateBatch(tree, cond, adv, masks), trainer.policy, trainer.procs,
                         cfg.train, torch.Generator().manual_seed(1))
        assert stats["trained_edges"] == 4 * 4 and stats["optimizer_steps"] == 1
    assert grads[0].abs().max() > 0
    assert torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-6 * float(grads[1].abs().max()))
