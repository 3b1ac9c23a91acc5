import math

import pytest
import torch

from flowrl.advantages import group_advantages
from flowrl.config import AdvantageConfig
from tests.helpers import tree_skeleton


def test_group_zscore_by_hand():
    r = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0])
    g = torch.tensor([0, 0, 0, 1, 1, 1])
    adv, stats = group_advantages(r, g, AdvantageConfig(eps=0.0))
    s = math.sqrt(2 / 3)  # biased std of 1, 2, 3
    assert adv.tolist() == pytest.approx([-1 / s, 0.0, 1 / s, 0.0, 0.0, 0.0], rel=1e-6)
    assert stats["zero_std_ratio"] == 0.5 and stats["zero_std_groups"] == 1


def test_unbiased_global_std_and_clip():
    r = torch.tensor([0.0, 10.0, 1.0, 1.0 + 1e-3])
    g = torch.tensor([0, 0, 1, 1])
    adv, _ = group_advantages(r, g, AdvantageConfig(std="global", ddof=1, eps=0.0, clip=5.0))
    gstd = torch.tensor([0.0, 10.0, 1.0, 1.001]).double().std().item()
    assert adv[0].item() == pytest.approx(-5 / gstd, rel=1e-5)
    assert adv[2].item() == pytest.approx(-0.0005 / gstd, rel=1e-4)
    adv, _ = group_advantages(torch.tensor([0.0, 100.0, 0.0, 0.0]), torch.tensor([0, 0, 0, 0]),
                              AdvantageConfig(eps=0.0, clip=1.5))
    assert adv.max().item() == 1.5


def test_nan_rewards_are_masked_and_counted():
    r = torch.tensor([1.0, float("nan"), 3.0, float("inf")])
    adv, stats = group_advantages(r, torch.tensor([0, 0, 0, 0]), AdvantageConfig(eps=0.0))
    assert torch.isfinite(adv).all()
    assert adv[1] == 0 and adv[3] == 0
    assert adv[0].item() == pytest.approx(-1.0) and adv[2].item() == pytest.approx(1.0)
    assert stats["reward_nan_count"] == 2


def test_all_equal_group_gives_zero_not_nan():
    adv, stats = group_advantages(torch.full((4,), 0.7), torch.zeros(4, dtype=torch.long), AdvantageConfig(eps=0.0))
    assert adv.tolist() == [0.0] * 4 and stats["zero_std_ratio"] == 1.0


def test_edge_values_are_mean_of_descendant_leaves():
    # root -> 2 children -> each 2 leaves: edge into a depth-1 node gets the mean of its two leaves
    tree = tree_skeleton([[0, 0], [0, 0, 1, 1]])
    values = tree.node_values_from_leaves(torch.tensor([1.0, 3.0, -2.0, 0.0]))
    assert values[1].tolist() == [2.0, -1.0]
    assert values[0].tolist() == [0.5]


def test_per_reward_advantages_weight_normalised_components():
    """DanceGRPO's multi-reward rule by hand: A = A_a + 0.5 A_b with each reward z-scored in its own group;
    the plain weighted sum is dominated by the large-scale reward instead."""
    from flowrl.rewards.registry import RewardScores

    from flowrl.algorithms import make_algorithm
    from flowrl.config import load_config

    cfg = load_config(None, ["advantage.combine=per_reward"])
    tree = tree_skeleton([[0, 1, 2, 3]], groups=[0, 0, 0, 0])  # one group of 4 one-step leaves
    a, b = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([100.0, 100.0, 300.0, 300.0])
    scores = RewardScores(a + 0.5 * b, {"a": a, "b": b}, torch.zeros(4, dtype=torch.bool))
    adv, keep, _ = make_algorithm(cfg).reward_advantages(tree, scores, {"a": 1.0, "b": 0.5}, 0)
    adv_a = (a - 2.5) / (1.25 ** 0.5 + 1e-4)
    adv_b = torch.tensor([-1.0, -1.0, 1.0, 1.0]) * 100 / (100 + 1e-4)
    assert torch.allclose(adv[1], adv_a + 0.5 * adv_b, atol=1e-5)
    assert all(bool(k.all()) for k in keep)
    scores.invalid[0] = True  # invalid in any reward: out of every component's statistics, advantage 0
    adv, _, _ = make_algorithm(cfg).reward_advantages(tree, scores, {"a": 1.0, "b": 0.5}, 0)
    assert float(adv[1][0]) == 0.0
    a2, b2 = a[1:], b[1:]  # [2, 3, 4], [100, 300, 300]: population std sqrt(2/3) and 200 sqrt(2) / 3
    want = (a2 - 3) / ((2 / 3) ** 0.5 + 1e-4) + 0.5 * (b2 - 700 / 3) / (200 * 2 ** 0.5 / 3 + 1e-4)
    assert torch.allclose(adv[1][1:], want, atol=1e-5)


def test_per_reward_needs_plain_group_advantages():
    from flowrl.config import load_config
    from flowrl.errors import ConfigError

    with pytest.raises(ConfigError, match="advantage.combine=per_reward"):
        load_config(None, ["advantage.combine=per_reward", "algorithm.name=superflow"])
