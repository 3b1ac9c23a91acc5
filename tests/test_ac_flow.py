"""AC-Flow (this package's reading): the critic's weights by hand, the warm-up, the critic learning, exact state."""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import make_cfg


def test_critic_weights_by_hand():
    from flowrl.algorithms.ac_flow import critic_weights

    w = critic_weights(torch.tensor([1.0, 0.0, -1.0]), 0.5)
    raw = [math.exp(0.5), 1.0, math.exp(-0.5)]
    assert w.tolist() == pytest.approx([r / (sum(raw) / 3) for r in raw])
    assert critic_weights(torch.tensor([100.0, 99.0]), 1.0).tolist() == pytest.approx(
        [2 * math.e / (math.e + 1), 2 / (math.e + 1)])  # shifted by the max first: no overflow


def test_loss_before_and_after_the_warm_up():
    """Per sample: w e, with w from the clipped shaped reward during the warm-up and from r - V after it."""
    from flowrl.algorithms.ac_flow import ACFlow, Critic, critic_weights
    from flowrl.config import load_config

    algo = ACFlow(load_config(None, ["algorithm.name=ac_flow", "algorithm.critic_warmup=1", "algorithm.adv_clip=2",
                                     "algorithm.tau=0.5"]))
    algo.critic = Critic(2, 8)
    x0, eps = torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4)
    t = torch.tensor([0.3, 0.5, 0.7])
    x_t = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * eps
    v = torch.randn(3, 2, 4, 4)
    adv = torch.tensor([3.0, 0.5, -1.0])  # the first clipped to 2
    e = ((v - (eps - x0)) ** 2).flatten(1).mean(1)
    during = algo.forward_process_loss(x0, x_t, t, v, None, adv)
    assert during.tolist() == pytest.approx((critic_weights(torch.tensor([2.0, 0.5, -1.0]), 0.5) * e).tolist(), rel=1e-5)
    algo.iteration = 1
    value = algo.critic(x_t, t).detach()
    after = algo.forward_process_loss(x0, x_t, t, v, None, adv)
    a = (torch.tensor([2.0, 0.5, -1.0]) - value).clamp(-2, 2)
    assert after.tolist() == pytest.approx((critic_weights(a, 0.5) * e).tolist(), rel=1e-5)
    after.sum().backward()  # the critic's squared error adds only its gradient
    assert all(p.grad is not None for p in algo.critic.parameters())


def test_the_critic_learns_and_resumes(tmp_path):
    from flowrl.trainer import Trainer

    cfg = make_cfg(tmp_path, "algorithm.name=ac_flow", "algorithm.group_size=4", "sampler.num_steps=4",
                   "train.prompts_per_iter=2", "rewards[0].name=jpeg_incompressibility", "train.kl_beta=1.0",
                   "algorithm.timesteps_per_sample=2", "algorithm.critic_lr=1e-2")
    trainer = Trainer(cfg)
    before = [p.detach().clone() for p in trainer.algorithm.critic.parameters()]
    rows = [trainer.iteration(i) for i in range(2)]
    assert rows[0]["critic_warm"] == 0.0 and rows[0]["kl_loss"] == 0.0
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.algorithm.critic.parameters()))
    state = trainer.algorithm.state_dict()
    other = Trainer(make_cfg(tmp_path / "b", *[f"algorithm.name=ac_flow", "algorithm.group_size=4"]))
    other.algorithm.load_state_dict(state)
    assert other.algorithm.iteration == 2
    for a, b in zip(other.algorithm.critic.state_dict().values(), trainer.algorithm.critic.state_dict().values()):
        assert torch.equal(a, b)
    assert other.algorithm.critic_optimizer.state_dict()["state"][0]["exp_avg"].shape == before[0].shape
