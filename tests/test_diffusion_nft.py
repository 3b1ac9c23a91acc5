"""DiffusionNFT: the forward-process loss by hand, the optimality probability, the old policy's schedule, and
training on the tiny model through the same rollouts, rewards and checkpoints."""

import pytest
import torch

from flowrl.algorithms.diffusion_nft import nft_loss, old_policy_decay, optimality_probability
from flowrl.config import load_config


def test_nft_loss_and_gradient_by_hand():
    """One element: x0 = 0, x_t = 1, t = 0.5, v_theta = 1.2, v_old = 1.0, beta = 1 -> v+ = 1.2, v- = 0.8;
    x0+ = 0.4, x0- = 0.6; L+ = 0.4^2 / 0.4 = 0.4, L- = 0.6^2 / 0.6 = 0.6; A = 2.5, A_max = 5 -> r = 0.75;
    loss = 5 (0.75 * 0.4 + 0.25 * 0.6) = 2.25. d/dv_theta: dL+/dv+ = 2 * 0.4 * (-0.5) / 0.4 = -1 (weight held),
    dL-/dv- = -1 and dv-/dv_theta = -1 -> 5 (0.75 * -1 + 0.25 * 1) = -2.5."""
    v = torch.tensor([[1.2]], requires_grad=True)
    r = optimality_probability(torch.tensor([2.5]), 5.0)
    assert r.tolist() == [0.75]
    loss = nft_loss(torch.zeros(1, 1), torch.ones(1, 1), torch.tensor([0.5]), v, torch.tensor([[1.0]]), r, 1.0, 5.0)
    assert loss.item() == pytest.approx(2.25)
    loss.sum().backward()
    assert v.grad.item() == pytest.approx(-2.5)


def test_with_the_old_policy_equal_the_gradient_is_2r_minus_1_times_the_x0_regression():
    g = torch.Generator().manual_seed(0)
    x0, x_t, v0 = (torch.randn(3, 2, 4, 4, generator=g) for _ in range(3))
    t = torch.tensor([0.2, 0.5, 0.9])
    adv = torch.tensor([-5.0, 0.0, 2.0])  # r = 0, 0.5, 0.7
    v = v0.clone().requires_grad_(True)
    nft_loss(x0, x_t, t, v, v0, optimality_probability(adv, 5.0), 0.5, 5.0).sum().backward()
    err = x_t - t.view(-1, 1, 1, 1) * v0 - x0
    w = err.abs().mean(dim=(1, 2, 3), keepdim=True)
    plain = 2 * err * -t.view(-1, 1, 1, 1) / w / err[0].numel()  # d mean(err^2 / w) / dv
    r = torch.tensor([0.0, 0.5, 0.7]).view(-1, 1, 1, 1)
    assert torch.allclose(v.grad, 5.0 * (2 * r - 1) * plain, atol=1e-5)


def test_optimality_probability_and_old_policy_schedules():
    assert optimality_probability(torch.tensor([-9.0, -5.0, 0.0, 1.0, 9.0]), 5.0).tolist() == pytest.approx(
        [0.0, 0.0, 0.5, 0.6, 1.0])
    assert [old_policy_decay("ramp", i) for i in (0, 100, 1000)] == [0.0, 0.1, 0.5]
    assert [old_policy_decay("delayed", i) for i in (74, 75, 175)] == [0.0, 0.0, pytest.approx(0.75)]
    assert old_policy_decay("delayed", 1000) == 0.999


def test_diffusion_nft_trains_on_the_tiny_model_and_resumes_its_old_policy(tmp_path):
    from flowrl.trainer import Trainer

    args = ["algorithm.name=diffusion_nft", "algorithm.group_size=3", "algorithm.timesteps_per_sample=2",
            "sampler.num_steps=4", "sampler.guidance_scale=1.0", "train.prompts_per_iter=2", "train.lr=1e-2",
            "train.kl_beta=1e-4", f"log.output_dir={tmp_path}", "log.run_name=n", "log.sample_every=0",
            "log.progress=false", "train.iterations=3", "log.save_every=1", "algorithm.old_decay=ramp"]
    trainer = Trainer(load_config(None, args))
    row = trainer.iteration(0)
    assert row["nfe_rollout"] == 6 * 4 and row["nfe_train"] == 6 * 2 and row["optimizer_steps"] == 1
    assert row["old_policy_gap"] == 0.0 and row["kl_loss"] == 0.0  # the old and reference policies start equal
    p = trainer.policy
    assert all(torch.equal(o, q) for o, q in zip(p.old, p.params))  # decay 0 at iteration 0: old = trained
    before = [q.detach().clone() for q in p.params]
    trainer.iteration(1)  # decay 0.001: old = 0.001 * (weights after 0) + 0.999 * (weights after 1)
    expect = [0.001 * b + 0.999 * q for b, q in zip(before, p.params)]
    assert all(torch.allclose(o, e, atol=1e-7) for o, e in zip(p.old, expect))
    trainer.save(1)
    resumed = Trainer(load_config(None, args + ["resume=latest"]))
    assert all(torch.equal(a, b) for a, b in zip(resumed.policy.old, p.old))
