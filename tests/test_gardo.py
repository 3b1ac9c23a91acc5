"""GARDO: diversity-aware advantages, ranks and the KL gate worked by hand; the adaptive reference resets."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_cfg


def test_diversity_advantages_by_hand():
    from flowrl.algorithms.gardo import diversity_advantages

    # one group of three: samples 0 and 2 point almost the same way, sample 1 at right angles to sample 0
    feats = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.1]])
    rewards = torch.tensor([0.9, 0.6, 0.3])
    adv, dist = diversity_advantages(rewards, feats, torch.tensor([0, 0, 0]))
    c = 1 / (1.01 ** 0.5)  # cos(sample 0, sample 2)
    d0, d1, d2 = 1 - c, 1 - 0.1 / 1.01 ** 0.5, 1 - c  # nearest-neighbour cosine distances
    assert dist.tolist() == pytest.approx([d0, d1, d2], abs=1e-6)
    mean_d = (d0 + d1 + d2) / 3
    # mean reward 0.6: samples 0 and 1 are at or above it and are scaled by d / mean d; sample 2 is not
    assert adv.tolist() == pytest.approx([0.3 * d0 / mean_d, 0.0, -0.3], abs=1e-6)
    plain, _ = diversity_advantages(rewards, feats, torch.tensor([0, 0, 0]), diversity=False)
    assert plain.tolist() == pytest.approx([0.3, 0.0, -0.3], abs=1e-6)  # no division by the std


def test_kl_gate_by_hand():
    from flowrl.algorithms.gardo import descending_ranks, kl_gate

    assert descending_ranks(torch.tensor([0.2, 0.9, 0.5])).tolist() == [3.0, 1.0, 2.0]
    main = torch.tensor([0.9, 0.8, 0.7, 0.6, 0.5])  # ranks 1..5
    aux = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5])  # ranks 5..1
    # u = rank_main - rank_aux = [-4, -2, 0, 2, 4]; non-negative u: [0, 2, 4]; their 1 - 0.5 quantile is 2
    gate, u = kl_gate(main, [aux], 0.5)
    assert u.tolist() == [-4.0, -2.0, 0.0, 2.0, 4.0]
    assert gate.tolist() == [False, False, False, False, True]
    gate, _ = kl_gate(main, [aux], 1.0)  # quantile 0: every u above 0
    assert gate.tolist() == [False, False, False, True, True]


def test_refuses_one_reward_and_no_kl():
    from flowrl.config import load_config
    from flowrl.errors import ConfigError

    with pytest.raises(ConfigError, match="add at least one more reward"):
        load_config(None, ["algorithm.name=gardo", "train.kl_beta=0.04"])
    with pytest.raises(ConfigError, match="gardo gates the KL"):
        load_config(None, ["algorithm.name=gardo", "rewards=[{name: jpeg_compressibility}, {name: aesthetic}]"])


def test_reference_resets(tmp_path):
    from flowrl.trainer import Trainer

    cfg = make_cfg(tmp_path, "algorithm.name=gardo", "algorithm.group_size=4", "sampler.num_steps=4",
                   "train.prompts_per_iter=2", "train.kl_beta=0.04", "algorithm.reset_every=1", "train.lr=1e-2",
                   "rewards=[{name: jpeg_incompressibility}, {name: 'tests.helpers:brightness'}]")
    trainer = Trainer(cfg)
    anchor0 = [a.clone() for a in trainer.policy.anchor]
    rows = [trainer.iteration(i) for i in range(3)]
    assert rows[0]["ratio_max_abs_dev_first_update"] < 1e-5
    assert [r["gardo_reference_reset"] for r in rows] == [0.0, 1.0, 0.0]  # more than 1 iteration since the reset
    assert 0 < rows[0]["gardo_gated"] < 1
    moved = max(float((a - b).abs().max()) for a, b in zip(trainer.policy.anchor, anchor0))
    assert moved > 0  # the reference is now the weights after iteration 1, not the starting ones
    now = max(float((a - p).abs().max()) for a, p in zip(trainer.policy.anchor, (p.detach() for p in trainer.policy.params)))
    assert now > 0  # iteration 2's update moved the weights past the reset copy
