"""Customized-GRPO: SARS's bonus and TDW's step weights worked by hand, the fused per-step advantages on a real
rollout tree, ratio 1 on the first update, and the two-reward check."""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import make_cfg


def test_sars_bonus_by_hand():
    from flowrl.algorithms.customized_grpo import sars_bonus

    a_h = torch.tensor([1.0, -1.0, -1.0, 0.5])
    a_d = torch.tensor([1.0, 1.0, -1.0, -0.5])
    t1, tq = 0.4 * math.tanh(1.0), 0.4 * math.tanh(0.25)
    # both good: +; a conflict: tanh of a negative product; both bad: -gamma tanh(+1)
    assert sars_bonus(a_h, a_d, 0.4).tolist() == pytest.approx([t1, -t1, -t1, -tq])


def test_tdw_weights_by_hand():
    from flowrl.algorithms.customized_grpo import tdw_weight

    assert tdw_weight(0, 25) == 0.7 and tdw_weight(5, 25) == 0.7
    assert tdw_weight(6, 25) == pytest.approx(0.3 + 0.4 * (1 - 1 / (1 + math.exp(3.2))))
    assert tdw_weight(10, 25) == pytest.approx(0.5)  # the sigmoid's midpoint
    assert tdw_weight(22, 25) == 0.5 and tdw_weight(24, 25) == 0.5
    assert tdw_weight(4, 10) == pytest.approx(0.5)  # step 4 of 10 is step 10 of 25


def test_fused_per_step_advantages_and_ratio_one(tmp_path):
    from flowrl.trainer import Trainer

    cfg = make_cfg(tmp_path, "algorithm.name=customized_grpo", "sampler.num_steps=4", "train.prompts_per_iter=2",
                   "algorithm.group_size=4", "rewards=[{name: jpeg_compressibility}, {name: clip}]")
    trainer = Trainer(cfg)
    row = trainer.iteration(0)
    assert row["ratio_max_abs_dev_first_update"] < 1e-5 and row["trained_edges"] > 0
    assert "sars_bonus_mean" in row and 0.0 <= row["sars_conflicts"] <= 1.0


def test_node_advantages_by_step_on_a_tree():
    """A tree of one prompt: a root that branches into 2 chains of 4 steps. Each node created by step k carries
    clip(w(k) A_h + (1 - w(k)) A_d + b) of the leaf below it."""
    from types import SimpleNamespace

    from flowrl.algorithms.customized_grpo import CustomizedGRPO, sars_bonus, tdw_weight
    from flowrl.config import load_config
    from flowrl.engine import rollout
    from flowrl.samplers.plans import RolloutPlan, StepSpec

    cfg = load_config(None, ["algorithm.name=customized_grpo", "sampler.num_steps=4",
                             "rewards=[{name: jpeg_compressibility}, {name: clip}]"])

    class Flat:  # a velocity of zero: the rollout only needs the shapes
        device = torch.device("cpu")

        def velocity(self, x, sigma, cond, guidance_scale=1.0, negative=None):
            return torch.zeros_like(x)

    cond = SimpleNamespace(embeds=torch.zeros(1, 1, 1), index=lambda idx: cond)
    plan = RolloutPlan([StepSpec(branch=2 if i == 0 else 1, trained=True) for i in range(4)])
    tree = rollout(Flat(), cond, plan, torch.linspace(1, 0, 5), (1, 2, 2), kernel="flow_grpo", noise_level=0.7,
                   generator=torch.Generator().manual_seed(0))
    r_h, r_d = torch.tensor([1.0, 3.0]), torch.tensor([2.0, 0.0])
    scores = SimpleNamespace(total=r_h + r_d, components={"h": r_h, "d": r_d}, invalid=torch.zeros(2, dtype=torch.bool))
    algo = CustomizedGRPO(cfg)
    node_adv, _, _ = algo.reward_advantages(tree, scores, {"h": 1.0, "d": 1.0}, 0)
    a_h, a_d = torch.tensor([-1.0, 1.0]), torch.tensor([1.0, -1.0])  # z-scores of two values (ddof 0)
    a_h, a_d = a_h * 1 / (1 + 1e-4), a_d / (1 + 1e-4)  # advantage.eps in the denominator
    b = sars_bonus(a_h, a_d, 0.4)
    for r in range(1, 5):
        w = tdw_weight(r - 1, 4)
        expect = (w * a_h + (1 - w) * a_d + b).tolist()
        leaf_of = [0, 1]  # round r holds the two chains in order
        assert node_adv[r].tolist() == pytest.approx([expect[i] for i in leaf_of], abs=1e-5)


def test_two_rewards_are_required():
    from flowrl.config import load_config
    from flowrl.errors import ConfigError

    with pytest.raises(ConfigError, match="customized_grpo fuses exactly two rewards"):
        load_config(None, ["algorithm.name=customized_grpo"])
