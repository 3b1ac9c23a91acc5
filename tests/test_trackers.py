"""SuperFlow tracker, AdaGRPO capability and fusion, zero-variance policies: hand-computed values (spec §4, §8)."""

import math
from pathlib import Path

import pytest
import torch

from flowrl.advantages import group_advantages
from flowrl.config import AdvantageConfig, load_config
from flowrl.trackers import BetaTracker, CapabilityEMA, adagrpo_advantages, superflow_advantages, superflow_group_sizes

ROOT = Path(__file__).resolve().parent.parent


def test_beta_tracker_by_hand():
    t = BetaTracker(rho=0.5)
    assert t.value("p") == 0.5
    t.update("p", torch.tensor([1.0, 0.0, 1.0]))  # a = 0.5 + 2, b = 0.5 + 1
    assert t.state["p"] == [2.5, 1.5] and t.value("p") == 0.625
    assert t.priority("p") == pytest.approx(math.sqrt(0.625 * 0.375 + 1e-6))
    t.update("p", torch.tensor([0.5, float("nan")]))  # NaN left out
    assert t.state["p"] == [1.75, 1.25]
    assert BetaTracker(reward_range=(-1.0, 1.0)).normalise(torch.tensor([0.0, 3.0])).tolist() == [0.5, 1.0]
    k = BetaTracker(rho_mode="kl_adaptive", d_half=0.06, rho_min=0.5)
    assert k.forgetting(0.06) == 0.5 and k.forgetting(0.0) == 0.96 and k.forgetting(1.0) == 0.5
    assert k.forgetting(0.03) == pytest.approx(2 ** -0.5)


def test_superflow_group_sizes_and_advantages_by_hand():
    assert superflow_group_sizes([0.0, 0.13, 0.3, 0.5], 4, 8, 4) == [4, 5, 7, 8]
    adv = superflow_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0.5, 0.5, 0.8, 0.8]), eps=0.0)
    a = torch.tensor([0.5, -0.5, 0.2, 0.2], dtype=torch.float64)
    assert adv.tolist() == pytest.approx(((a - 0.1) / math.sqrt(0.135)).tolist(), abs=1e-6)


def test_adagrpo_fusion_and_capability_by_hand():
    adv = adagrpo_advantages(torch.tensor([1.0, 2.0, 3.0]), torch.zeros(3, dtype=torch.long), 1.5, 0.5, eps=0.0)
    intra = [-math.sqrt(1.5), 0.0, math.sqrt(1.5)]  # (r - 2) / sqrt(2/3)
    assert adv.tolist() == pytest.approx([intra[0] - 1.0, 0.25, intra[2] + 0.75], abs=1e-6)
    # one-sided global term: centred instead of split
    adv = adagrpo_advantages(torch.tensor([2.0, 3.0]), torch.zeros(2, dtype=torch.long), 1.0, 0.5, eps=0.0)
    assert adv.tolist() == pytest.approx([-2.0, 2.0])
    ema = CapabilityEMA(0.8)
    ema.update(torch.tensor([1.0, 3.0]))
    assert (ema.mean, ema.var) == (2.0, 1.0)
    ema.update(torch.tensor([5.0, 5.0]))
    assert (ema.mean, ema.var) == pytest.approx((2.6, 0.8))
    assert ema.closest(torch.tensor([2.5, 0.0, 3.0]), 2) == [0, 2]


@pytest.mark.parametrize("policy, expect", [("zero", 0.0), ("global", 0.5 / math.sqrt(3.5 / 6)),
                                            ("tracker", 1.0 / math.sqrt(3.5 / 6))])
def test_zero_variance_policies(policy, expect):
    r = torch.tensor([2.0, 2.0, 2.0, 0.0, 1.0, 2.0])
    g = torch.tensor([0, 0, 0, 1, 1, 1])
    adv, stats = group_advantages(r, g, AdvantageConfig(eps=0.0, zero_variance=policy), baselines=torch.ones(6))
    assert adv[:3].tolist() == pytest.approx([expect] * 3)
    assert stats["zero_std_groups"] == 1 and stats["zero_std_groups_given_advantage"] == (policy != "zero")


def _iteration(tmp_path, config, *overrides):
    from flowrl.trainer import Trainer

    cfg = load_config(ROOT / "configs" / config, [f"log.output_dir={tmp_path}", "log.run_name=t", "log.progress=false",
                                                  "log.sample_every=0", "log.save_every=0", *overrides])
    trainer = Trainer(cfg)
    return trainer, trainer.iteration(0)


@pytest.mark.parametrize("policy", ["zero", "global", "tracker", "drop_refill"])
def test_all_equal_groups_never_give_nan(tmp_path, policy):
    trainer, row = _iteration(tmp_path, "tiny_flow_grpo.yaml", "rewards=[{name: 'tests.helpers:per_prompt_constant'}]",
                              f"advantage.zero_variance={policy}", "train.prompts_per_iter=3", "algorithm.group_size=2",
                              "advantage.refill_extra=1")
    assert all(math.isfinite(v) for v in row.values() if isinstance(v, float))
    n_groups = 4 if policy == "drop_refill" else 3
    assert row["zero_std_groups"] == n_groups
    if policy == "zero":
        assert row["trained_edges"] == 0
    if policy == "drop_refill":
        assert row["groups_dropped"] == 4 and row["trained_edges"] == 0
    if policy in ("global", "tracker"):  # prompts differ, so the batch std is not zero: every group is trained
        assert row["zero_std_groups_given_advantage"] == 3 and row["trained_edges"] > 0


def test_superflow_iteration(tmp_path):
    trainer, row = _iteration(tmp_path, "tiny_superflow.yaml", "train.prompts_per_iter=2")
    # unseen prompts have v = 0.5, the highest priority: the largest group
    assert row["group_size_mean"] == 8 and row["leaves"] == 16
    assert len(trainer.algorithm.tracker.state) == 2
    assert row["ratio_max_abs_dev_first_update"] < 1e-5


def test_ada_grpo_iteration(tmp_path):
    trainer, row = _iteration(tmp_path, "tiny_ada_grpo.yaml")
    assert trainer.algorithm.capability.count == 1 and row["curriculum/capability"] == pytest.approx(row["curriculum/anchor_score_mean"])
    assert row["trained_edges"] == 2 * 4 * 6 and row["nfe_train"] == 2 * 4
    assert row["ratio_max_abs_dev_first_update"] < 1e-5


@pytest.mark.parametrize("config, extra", [("tiny_superflow.yaml", ["algorithm.min_group=2",
                                                                     "algorithm.max_group=3"]),
                                           ("tiny_ada_grpo.yaml", ["algorithm.candidates=3",
                                                                   "algorithm.steps=[0,1]"])])
def test_resume_restores_tracker_state_exactly(tmp_path, config, extra):
    """The tracker / capability EMA is part of the checkpoint: a resumed run repeats the uninterrupted one."""
    from flowrl.report import read_metrics
    from flowrl.trainer import Trainer

    def cfg(sub, iters, *more):
        return load_config(ROOT / "configs" / config, [f"log.output_dir={tmp_path / sub}", "log.run_name=t",
                                                       "log.progress=false", "log.sample_every=0", "log.save_every=1",
                                                       "sampler.num_steps=4", "train.prompts_per_iter=2",
                                                       f"train.iterations={iters}", *extra, *more])

    full = Trainer(cfg("a", 3))
    full.train()
    Trainer(cfg("b", 2)).train()
    resumed = Trainer(cfg("b", 3, "resume=latest"))
    assert resumed.start_iteration == 2
    resumed.train()
    a = read_metrics(full.run_dir / "metrics.jsonl")[2]
    b = read_metrics(resumed.run_dir / "metrics.jsonl")[2]
    for key in ["reward_mean/total", "ratio_mean", "leaves", "trained_edges"]:
        assert a[key] == b[key], key
