"""Reward-filtered online SFT: which samples are kept, by hand, and the loss is the plain flow-matching error on them."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_cfg


def test_which_samples_are_kept():
    from flowrl.algorithms.sft import keep_indicator

    rewards = torch.tensor([0.1, 0.9, 0.5, 0.3, float("nan"), 0.3])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    assert keep_indicator(rewards, groups, "best").tolist() == [0, 1, 0, 1, 0, 1]  # a tie at the best: both
    assert keep_indicator(rewards, groups, "above_mean").tolist() == [0, 1, 0, 0, 0, 0]  # 0.5 = the mean: not above


def test_the_loss_is_the_flow_matching_error_of_the_kept_samples():
    from flowrl.algorithms.sft import SFT
    from flowrl.config import load_config

    algo = SFT(load_config(None, ["algorithm.name=sft"]))
    x0, eps, t = torch.zeros(2, 1, 2, 2), torch.ones(2, 1, 2, 2), torch.tensor([0.5, 0.5])
    v = torch.full((2, 1, 2, 2), 0.6)
    loss = algo.forward_process_loss(x0, 0.5 * x0 + 0.5 * eps, t, v, None, torch.tensor([1.0, 0.0]))
    assert loss.tolist() == pytest.approx([0.16, 0.0])  # (0.6 - 1)^2 on the kept sample


def test_one_iteration(tmp_path):
    from flowrl.trainer import Trainer

    cfg = make_cfg(tmp_path, "algorithm.name=sft", "algorithm.group_size=4", "sampler.num_steps=4",
                   "train.prompts_per_iter=2")
    row = Trainer(cfg).iteration(0)
    # at least one best sample per prompt, and fewer than all 8 (JPEG sizes can tie at a group's best: all kept)
    assert row["optimizer_steps"] >= 1 and 2.0 <= row["sft_kept"] < 8.0
