"""Online Diffusion-DPO: the pairs and the loss worked by hand, its gradient's direction, one iteration."""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import make_cfg


def test_preference_pairs():
    from flowrl.algorithms.online_dpo import preference_pairs

    rewards = torch.tensor([0.2, 0.9, 0.1, 0.5, 0.5, 0.7, float("nan"), 0.3])
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    assert preference_pairs(rewards, groups) == [(1, 2), (5, 7)]  # group 1's rewards are equal: no pair


def test_the_dpo_loss_by_hand():
    from flowrl.losses import dpo_loss

    # chosen improved by 0.02 against the reference, rejected worsened by 0.01: z = -(100 / 2)(-0.02 - 0.01) = 1.5
    loss = dpo_loss(torch.tensor([0.08]), torch.tensor([0.10]), torch.tensor([0.21]), torch.tensor([0.20]), 100.0)
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-1.5)))
    e_w = torch.tensor([0.10], requires_grad=True)
    dpo_loss(e_w, torch.tensor([0.10]), torch.tensor([0.20]), torch.tensor([0.20]), 100.0).sum().backward()
    assert e_w.grad.item() == pytest.approx(50 * 0.5)  # d/de_w at z = 0: (beta / 2) sigmoid(0): lowering e_w helps


def test_one_iteration(tmp_path):
    from flowrl.trainer import Trainer

    cfg = make_cfg(tmp_path, "algorithm.name=online_dpo", "algorithm.group_size=4", "sampler.num_steps=4",
                   "train.prompts_per_iter=2", "rewards[0].name=jpeg_incompressibility")
    row = Trainer(cfg).iteration(0)
    assert row["dpo_pairs"] == 2 and row["optimizer_steps"] >= 1
    assert row["policy_loss"] == pytest.approx(math.log(2), abs=1e-4)  # first step: policy = reference, z = 0
    assert row["nfe_train"] == 2 * 2 * 2  # two pairs x two sigmas (indices 1..3) x two samples


def test_full_fine_tuning_is_refused():
    from flowrl.config import load_config
    from flowrl.errors import ConfigError

    with pytest.raises(ConfigError, match="online_dpo compares the policy with the LoRA-disabled model"):
        load_config(None, ["algorithm.name=online_dpo", "train.lora.enabled=false"])
