"""The Delightful Policy Gradient: the gate and the gradient worked by hand, ratio 1 on the first update."""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import make_cfg


def sig(x):
    return 1 / (1 + math.exp(-x))


def test_the_gate_and_gradient_by_hand_raw_surprisal():
    from flowrl.losses import delight_gated_loss

    log_prob = torch.tensor([-0.5, -2.0, -2.0, -12.0])  # surprisal 0.5, 2, 2, 12 (clipped to 10)
    adv = torch.tensor([1.0, 1.0, -1.0, 1.0])
    log_ratio = torch.zeros(4, requires_grad=True)  # the first update: pi = pi_old
    loss, ratio, gate = delight_gated_loss(log_ratio, log_prob, adv, eta=1.0, clip=10.0, surprisal="raw")
    expect = [sig(0.5), sig(2.0), sig(-2.0), sig(10.0)]  # a rare success passes, a rare failure is damped
    assert gate.tolist() == pytest.approx(expect)
    assert loss.tolist() == [0.0] * 4 and ratio.tolist() == [1.0] * 4
    loss.sum().backward()
    assert log_ratio.grad.tolist() == pytest.approx([-e * a for e, a in zip(expect, adv.tolist())])
    _, _, hot = delight_gated_loss(torch.zeros(4), log_prob, adv, eta=2.0, clip=10.0, surprisal="raw")
    assert hot.tolist() == pytest.approx([sig(0.25), sig(1.0), sig(-1.0), sig(5.0)])  # eta divides chi


def test_the_centred_surprisal_by_hand():
    from flowrl.losses import delight_gated_loss

    log_prob = torch.tensor([-1.0, -3.0])  # surprisal 1, 3: centred and scaled to -1, +1
    adv = torch.tensor([2.0, 2.0])
    _, _, gate = delight_gated_loss(torch.zeros(2), log_prob, adv, surprisal="centred")
    assert gate.tolist() == pytest.approx([sig(-2.0), sig(2.0)], abs=1e-6)


def test_one_iteration_with_ratio_one(tmp_path):
    from flowrl.trainer import Trainer

    cfg = make_cfg(tmp_path, "algorithm.name=delightful_pg", "sampler.num_steps=4", "train.prompts_per_iter=2")
    row = Trainer(cfg).iteration(0)
    assert row["ratio_max_abs_dev_first_update"] < 1e-5 and row["trained_edges"] > 0
    assert 0.0 < row["delight_gate"] < 1.0
