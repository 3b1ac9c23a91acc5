"""Flow-DPPO: the divergence and the masked loss worked by hand, the first update's ratio 1 with nothing dropped,
and the refusal of GRPO-Guard beside it."""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import make_cfg


def test_the_divergence_mask_by_hand():
    from flowrl.losses import divergence_masked_loss

    ratio = torch.tensor([1.2, 0.8, 1.2, 0.8, 1.0, 1.2])
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 2.0, 1.0])
    div = torch.tensor([2e-5, 2e-5, 2e-5, 2e-5, 0.0, 5e-6])
    loss, r, dropped = divergence_masked_loss(ratio.log(), adv, div, 1e-5)
    # 0, 1: far and pushing on -> dropped; 2, 3: far but correcting -> kept (-A r); 4: no move; 5: pushing on but
    # inside the trust region -> kept
    assert dropped.tolist() == [True, True, False, False, False, False]
    assert loss.tolist() == pytest.approx([0.0, 0.0, 1.2, -0.8, -2.0, -1.2])
    assert r.tolist() == pytest.approx(ratio.tolist())
    # the gradient of a kept edge is -A r d(log r), of a dropped one 0
    lr = ratio.log().clone().requires_grad_(True)
    divergence_masked_loss(lr, adv, div, 1e-5)[0].sum().backward()
    assert lr.grad.tolist() == pytest.approx([0.0, 0.0, 1.2, -0.8, -2.0, -1.2])


def test_the_transition_divergence_by_hand():
    from flowrl.losses import transition_divergence

    mean_old = torch.zeros(2, 3, 4, 4)
    mean = mean_old + torch.tensor([0.1, 0.2]).view(2, 1, 1, 1)
    std = torch.tensor([0.5, 0.5]).view(2, 1, 1, 1)
    assert transition_divergence(mean, mean_old, std).tolist() == pytest.approx([0.01 / 0.5, 0.04 / 0.5])
    assert transition_divergence(mean, mean_old, None).tolist() == pytest.approx([0.005, 0.02])


def test_one_iteration_ratio_one_and_nothing_dropped_on_the_first_update(tmp_path):
    from flowrl.trainer import Trainer

    cfg = make_cfg(tmp_path, "algorithm.name=flow_dppo", "sampler.num_steps=4", "train.prompts_per_iter=2",
                   "train.inner_epochs=2", "train.lr=5e-2")
    row = Trainer(cfg).iteration(0)
    assert row["ratio_max_abs_dev_first_update"] < 1e-5 and row["trained_edges"] > 0
    assert row["dppo_dropped_first_update"] == 0.0  # the first update's transitions are the rollout's: D = 0
    assert 0.0 <= row["dppo_dropped"] <= 1.0 and math.isfinite(row["dppo_divergence_max"])
    assert row["dppo_divergence_max"] > 0  # the second epoch moved


def test_grpo_guard_beside_flow_dppo_is_refused():
    from flowrl.config import load_config
    from flowrl.errors import ConfigError

    with pytest.raises(ConfigError, match="train.grpo_guard: Flow-DPPO's divergence mask replaces the ratio clip"):
        load_config(None, ["algorithm.name=flow_dppo", "train.grpo_guard=true"])
