"""AWM: the weightings and the advantage-weighted loss worked by hand, its gradient against a finite difference,
the stratified training sigmas, and one iteration on every family (the parametrised test)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_cfg


def test_the_weightings_by_hand():
    from flowrl.algorithms.awm import matching_weight

    l, s = torch.tensor([0.16, 1.0]), torch.tensor([0.5, 0.25])
    assert matching_weight(l, s, "uniform").tolist() == pytest.approx([0.16, 1.0])
    assert matching_weight(l, s, "sigma").tolist() == pytest.approx([0.08, 0.25])
    assert matching_weight(l, s, "sigma2").tolist() == pytest.approx([0.04, 0.0625])
    assert matching_weight(l, s, "huber").tolist() == pytest.approx([0.5 * (0.4 - 1e-5), 0.25 * (1 - 1e-5)], abs=1e-7)
    # ghuber, p = 0.25: (sigma / p)((l + 1e-10)^p - 1e-10^p), with 1e-10^0.25 = 10^-2.5 = 0.0031623
    assert matching_weight(l, s, "ghuber", 0.25).tolist() == pytest.approx(
        [2 * (0.16 ** 0.25 - 10 ** -2.5), 1 - 10 ** -2.5], abs=1e-5)


def test_the_loss_is_the_advantage_weighted_matching_error():
    from flowrl.algorithms.awm import AWM
    from flowrl.config import load_config

    algo = AWM(load_config(None, ["algorithm.name=awm", "algorithm.weighting=uniform"]))
    x0 = torch.zeros(2, 1, 2, 2)
    eps = torch.ones(2, 1, 2, 2)
    t = torch.tensor([0.5, 0.5])
    x_t = 0.5 * x0 + 0.5 * eps
    v = torch.full((2, 1, 2, 2), 0.6, requires_grad=True)  # target eps - x0 = 1: error 0.16
    adv = torch.tensor([10.0, -2.5])  # clipped to 5 then / 5: 1, -0.5
    loss = algo.forward_process_loss(x0, x_t, t, v, None, adv)
    assert loss.tolist() == pytest.approx([0.16, -0.08])
    loss.sum().backward()  # d/dv of A_hat mean((v - 1)^2) = A_hat 2 (v - 1) / 4 per element
    assert v.grad[0].flatten().tolist() == pytest.approx([1 * 2 * -0.4 / 4] * 4)
    assert v.grad[1].flatten().tolist() == pytest.approx([-0.5 * 2 * -0.4 / 4] * 4)


def test_stratified_training_sigmas_follow_the_published_draw():
    """The published rule written out (T = 14, K = 6): boundaries linspace(1, 12, 7) -> [1, 2, 4, 6, 8, 10, 12] as
    integers, index = lower + floor(u (upper - lower)); index 1 always, 12 never; ``discrete`` starts at 0."""
    from flowrl.algorithms.forward_process import stratified_indices

    gen, ref = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(200):
        idx = stratified_indices(14, 6, gen)
        u = torch.rand(6, generator=ref)
        lower, upper = torch.tensor([1, 2, 4, 6, 8, 10]), torch.tensor([2, 4, 6, 8, 10, 12])
        assert idx.tolist() == (lower + (u * (upper - lower)).long()).tolist()
        seen |= set(idx.tolist())
    assert seen == set(range(1, 12))  # 1..11: index 1 in every draw, 12 in none
    assert stratified_indices(14, 6, torch.Generator().manual_seed(0), start=0)[0] in (0, 1)
    assert stratified_indices(4, 6, gen).tolist()[:1] == [1]  # strata of width 0 give their lower bound


def test_one_iteration_trains_and_uses_no_old_policy(tmp_path):
    from flowrl.trainer import Trainer

    cfg = make_cfg(tmp_path, "algorithm.name=awm", "algorithm.group_size=4", "sampler.num_steps=6",
                   "train.prompts_per_iter=2", "train.kl_beta=0.01")
    trainer = Trainer(cfg)
    assert trainer.policy.old is None
    row = trainer.iteration(0)
    assert row["optimizer_steps"] >= 1 and row["nfe_train"] == 8 * 6  # 8 samples x K = 6 draws (repeats on a short grid)
    assert row["policy_loss"] == row["policy_loss"] and row["kl_loss"] == 0.0  # first step: v = v_ref
