"""DGPO: the group preference rows and the denoising-ratio clip worked by hand, one iteration's ratio and count."""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import make_cfg


def test_group_preference_rows_by_hand():
    from flowrl.losses import group_preference_loss

    err = torch.tensor([0.10, 0.30], requires_grad=True)
    err_ref = torch.tensor([0.12, 0.28])
    adv = torch.tensor([1.0, -1.0])
    # S = (100 / 2) (1 (0.10 - 0.12) - 1 (0.30 - 0.28)) = 50 (-0.04) = -2: the group already prefers the positive one
    rows = group_preference_loss(err, err_ref, adv, 100.0)
    w = 1 / (1 + math.exp(2.0))
    assert rows.tolist() == pytest.approx([w * 0.10, -w * 0.30])
    rows.sum().backward()
    assert err.grad.tolist() == pytest.approx([w, -w])  # the score is detached: d/de_i = sigmoid(S) A_i
    # the gradient is -log sigmoid(-S)'s, up to beta / K: d/de_0 of softplus(S) = sigmoid(S) (beta / K) A_0
    e = torch.tensor([0.10, 0.30], requires_grad=True)
    torch.nn.functional.softplus((100.0 / 2) * (adv * (e - err_ref)).sum()).backward()
    assert (e.grad / 50).tolist() == pytest.approx(err.grad.tolist())


def test_dsm_clip_by_hand():
    from flowrl.losses import dsm_clip

    err_old = torch.tensor([0.10, 0.10, 0.10, 0.10])
    err = torch.tensor([0.08, 0.12, 0.12, 0.099])  # rho = exp(0.02), exp(-0.02), exp(-0.02), exp(0.001)
    adv = torch.tensor([1.0, 1.0, -1.0, 1.0])
    # c = 0.01: rho 1.0202 > 1.01 with A > 0 (clip); rho 0.980 with A > 0 (keep); rho 0.980 < 0.99 with A < 0
    # (clip); rho 1.001 inside (keep)
    assert dsm_clip(err, err_old, adv, 0.01).tolist() == [True, False, True, False]


def test_training_sigmas_are_shared_and_truncated():
    from flowrl.algorithms.dgpo import DGPO
    from flowrl.config import load_config

    cfg = load_config(None, ["algorithm.name=dgpo", "sampler.num_steps=10", "algorithm.trunc_steps=6",
                             "algorithm.timesteps_per_sample=4"])
    sigmas = torch.linspace(1, 0, 11)
    t = DGPO(cfg).training_timesteps(3, sigmas, torch.Generator().manual_seed(0))
    assert t.shape == (3, 4) and torch.equal(t[0], t[1]) and torch.equal(t[0], t[2])
    assert len(set(t[0].tolist())) == 4 and all(s >= 0.5 - 1e-6 for s in t[0].tolist())  # indices 0..5: sigma >= 0.5


def test_one_iteration(tmp_path):
    from flowrl.trainer import Trainer

    cfg = make_cfg(tmp_path, "algorithm.name=dgpo", "algorithm.group_size=4", "sampler.num_steps=4",
                   "train.prompts_per_iter=2", "rewards[0].name=jpeg_incompressibility",
                   "algorithm.timesteps_per_sample=2", "train.num_minibatches=2")
    row = Trainer(cfg).iteration(0)
    assert row["ratio_max_abs_dev_first_update"] < 1e-6  # the EMA is the rollout's weights: rho = 1
    assert row["nfe_train"] == 2 * 2 * 4 * 3  # groups x sigmas x samples x (policy, reference, EMA)
    assert row["optimizer_steps"] == 2
