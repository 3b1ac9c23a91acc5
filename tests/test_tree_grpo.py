"""TreeGRPO: its window law, its plan, and the sibling-softmax backup written out by hand."""

import math
import random

import pytest
import torch

from flowrl.algorithms.tree_grpo import TreeGRPO, window_start_law
from flowrl.config import load_config
from tests.helpers import tree_skeleton


def test_the_window_start_follows_the_truncated_geometric_law():
    law = window_start_law(10, 3, 0.5)  # i in 0..6: (1 - r) r^i / (1 - r^7)
    assert law == pytest.approx([0.5 * 0.5**i / (1 - 0.5**7) for i in range(7)]) and sum(law) == pytest.approx(1)
    assert window_start_law(10, 3, 1.0) == pytest.approx([1 / 7] * 7)
    algo = TreeGRPO(load_config("configs/tiny_shapes_tree_grpo.yaml", ["algorithm.window_r=0.5"]))
    rng = random.Random(0)
    draws = [algo.window_start(rng) for _ in range(20000)]
    for i in range(7):
        assert draws.count(i) / len(draws) == pytest.approx(law[i], abs=0.01)


def test_the_plan_branches_k_ways_in_the_window_only():
    algo = TreeGRPO(load_config("configs/tiny_shapes_tree_grpo.yaml"))
    plan = algo.plan(0, random.Random(3))
    start = plan.notes["window_start"]
    for i, s in enumerate(plan.steps):
        inside = start <= i < start + 3
        assert (s.sde, s.trained, s.branch) == ((True, True, 2) if inside else (False, False, 1)), i
    assert plan.roots_per_prompt == 1


def test_the_sibling_softmax_backup_by_hand():
    """Two levels, k = 2: leaves a..d with advantages; each parent's advantage is sum_e softmax(logp_e) A_e, and the
    root's edges carry the parents' advantages."""
    lp1, lp2 = [0.2, -0.4], [0.1, 0.3, -1.0, 0.5]
    tree = tree_skeleton([[0, 0], [0, 0, 1, 1]], [lp1, lp2])
    algo = TreeGRPO(load_config("configs/tiny_shapes_tree_grpo.yaml", ["advantage.ddof=0", "advantage.eps=0"]))
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0])
    node_adv, keep, _ = algo.advantages(tree, rewards, 0)
    z = (rewards - rewards.mean()) / rewards.std(correction=0)
    assert node_adv[2].tolist() == pytest.approx(z.tolist(), abs=1e-6)

    def softmax(a, b):
        return math.exp(a) / (math.exp(a) + math.exp(b)), math.exp(b) / (math.exp(a) + math.exp(b))

    w = softmax(lp2[0], lp2[1])
    u = softmax(lp2[2], lp2[3])
    parents = [w[0] * float(z[0]) + w[1] * float(z[1]), u[0] * float(z[2]) + u[1] * float(z[3])]
    assert node_adv[1].tolist() == pytest.approx(parents, abs=1e-6)
    r = softmax(lp1[0], lp1[1])
    assert node_adv[0].tolist() == pytest.approx([r[0] * parents[0] + r[1] * parents[1]], abs=1e-6)
    # a low temperature (as the sum over the latent's elements does) sharpens the weights toward the likelier sibling
    sharp = TreeGRPO(load_config("configs/tiny_shapes_tree_grpo.yaml", ["algorithm.temperature=0.01",
                                                                         "advantage.ddof=0", "advantage.eps=0"]))
    adv = sharp.advantages(tree, rewards, 0)[0]
    assert adv[1][0] == pytest.approx(float(z[1]), abs=1e-4) and adv[1][1] == pytest.approx(float(z[3]), abs=1e-4)


def test_group_size_must_match_the_tree():
    from flowrl.errors import ConfigError

    with pytest.raises(ConfigError, match="must equal trees_per_prompt x branch_factor \\*\\* depth = 1 x 2\\^3 = 8"):
        load_config("configs/tiny_shapes_tree_grpo.yaml", ["algorithm.group_size=4"])
    with pytest.raises(ConfigError, match="algorithm.depth: a window of 3 steps needs at least 4"):
        load_config("configs/tiny_shapes_tree_grpo.yaml", ["sampler.num_steps=3"])
