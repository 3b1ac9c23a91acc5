"""Denoising trees: BranchGRPO fusion / depth advantages / pruning, TempFlow and E-GRPO plans, accounting.
Expected values are computed by hand from the papers' formulas (BranchGRPO, TempFlow-GRPO, E-GRPO)."""

import math
from pathlib import Path

import pytest
import torch
from flowrl.samplers import static_shift_sigmas

from flowrl import trees
from flowrl.algorithms import make_algorithm
from flowrl.algorithms.e_grpo import entropy_merge_lengths, step_entropy_score
from flowrl.config import load_config
from flowrl.engine import Tree, rollout, sibling_noise
from tests.helpers import tree_skeleton

ROOT = Path(__file__).resolve().parent.parent


def skeleton_from_plan(plan) -> Tree:
    """A latent-free tree with the plan's main-line structure (one prompt)."""
    parents, n = [], plan.roots_per_prompt
    for s in plan.steps:
        parents.append(torch.arange(n).repeat_interleave(s.branch).tolist())
        n *= s.branch
    return tree_skeleton(parents, groups=[0] * plan.roots_per_prompt)


def branch_cfg(*overrides):
    return load_config(ROOT / "configs/tiny_branch_grpo.yaml", ["log.progress=false", *overrides])


# ------------------------------------------------------------------------------------------- accounting
def test_branch_tree_counts_match_the_paper_arithmetic():
    plan = make_algorithm(branch_cfg()).plan(0)
    c = plan.counts()
    assert (c["leaves"], c["edges"], c["nfe"], c["trained_edges"]) == (16, 218, 203, 218)
    assert plan.accounting()["edges_per_leaf"] == 13.625  # the paper reports 13.68
    mix = make_algorithm(load_config(ROOT / "configs/tiny_branch_grpo_mix.yaml")).plan(0)
    assert [i for i, s in enumerate(mix.steps) if s.sde] == [0, 1, 2, 3, 6, 9]
    assert mix.counts()["trained_edges"] == 2 + 2 + 2 + 4 + 8 + 16  # edges created by the SDE steps
    assert mix.counts()["nfe"] == 203  # Mix saves gradient work, not rollout work


def test_width_pruning_trains_138_of_218_edges():
    cfg = branch_cfg()
    tree = skeleton_from_plan(make_algorithm(cfg).plan(0))
    rewards = torch.randn(16, generator=torch.Generator().manual_seed(0))
    values = trees.fuse_rewards(tree, rewards)
    adv, _ = trees.depth_advantages(tree, values)
    for mode in ("parent_top1", "extreme", "chain_ratio", "global_ratio"):
        keep = trees.width_prune_masks(tree, 9, mode, values, adv, rewards, ratio=0.5)
        assert sum(int(k.sum()) for k in keep[1:]) == 138, mode
        # distinct parents of the kept edges: 43 nodes before the last split's children, then one per kept edge
        parents = {(r - 1, int(tree.parent[r][c])) for r in range(1, 21) for c in torch.nonzero(keep[r]).flatten().tolist()}
        if mode in ("parent_top1", "extreme"):
            assert len(parents) == 43 + 80
    # rounds up to the last split's children (depth 10) are never pruned
    assert all(bool(keep[r].all()) for r in range(11))


def test_pruning_keeps_exactly_the_expected_edges_on_a_hand_tree():
    # splits at steps 0 and 1 (K = 2), one more step: round 3 holds the post-split edges (one per chain)
    tree = tree_skeleton([[0, 0], [0, 0, 1, 1], [0, 1, 2, 3]])
    r = torch.tensor([1.0, 3.0, -2.0, 0.0])
    values = trees.fuse_rewards(tree, r)
    adv, _ = trees.depth_advantages(tree, values)
    top1 = trees.width_prune_masks(tree, 1, "parent_top1", values, adv, r)
    assert top1[3].tolist() == [False, True, False, True] and top1[2].all() and top1[1].all()
    extreme = trees.width_prune_masks(tree, 1, "extreme", values, adv, r, extreme_b=1)
    assert extreme[3].tolist() == [False, True, True, False]
    assert trees.depth_prune_masks(tree, [2])[2].tolist() == [False] * 4
    # the code's window slides one depth earlier every 30 iterations and stops at the stop depth
    assert trees.depth_window([15, 16, 17, 18], 65, 30, 10) == [13, 14, 15, 16]
    assert trees.depth_window([15, 16, 17, 18], 300, 30, 10) == [10, 11, 12, 13]


# ------------------------------------------------------------------------------------------- advantages
def test_uniform_fusion_and_depth_zscore_by_hand():
    tree = tree_skeleton([[0, 0], [0, 0, 1, 1]])
    values = trees.fuse_rewards(tree, torch.tensor([1.0, 3.0, -2.0, 0.0]))
    assert values[1].tolist() == [2.0, -1.0] and values[0].tolist() == [0.5]
    adv, stats = trees.depth_advantages(tree, values, ddof=1, eps=0.0)
    assert adv[0].tolist() == [0.0]  # a depth with one node gets no advantage
    assert adv[1] == pytest.approx([1 / math.sqrt(2), -1 / math.sqrt(2)], abs=1e-6)
    std = math.sqrt(13 / 3)  # unbiased std of (1, 3, -2, 0)
    assert adv[2] == pytest.approx([0.5 / std, 2.5 / std, -2.5 / std, -0.5 / std], abs=1e-6)
    assert stats == {"depth_groups": 2, "depth_groups_zero_std": 0}


def test_several_trees_per_prompt_pool_their_depth_statistics_by_hand():
    """Two trees for one prompt (roots 0 and 1), each branching 2 ways at step 0, then one chain step; leaf
    rewards (1, 2 | 3, 6). Per tree the depth-1 z-scores are only signs (-0.707, +0.707 in both trees); pooled over
    the prompt's trees: mean 3, unbiased std sqrt(14 / 3), so (-2, -1, 0, 3) / 2.1602. A second prompt's trees
    form their own pool."""
    tree = tree_skeleton([[0, 0, 1, 1], [0, 1, 2, 3]], groups=[0, 0])
    values = trees.fuse_rewards(tree, torch.tensor([1.0, 2.0, 3.0, 6.0]))
    adv, stats = trees.depth_advantages(tree, values, ddof=1, eps=0.0)
    std = math.sqrt(14 / 3)
    for r in (1, 2):
        assert adv[r] == pytest.approx([-2 / std, -1 / std, 0.0, 3 / std], abs=1e-6)
    assert stats == {"depth_groups": 2, "depth_groups_zero_std": 0}
    two = tree_skeleton([[0, 0, 1, 1], [0, 1, 2, 3]], groups=[0, 1])  # one tree per prompt: per-tree signs
    adv2, _ = trees.depth_advantages(two, trees.fuse_rewards(two, torch.tensor([1.0, 2.0, 3.0, 6.0])), ddof=1, eps=0.0)
    assert adv2[1] == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)] * 2, abs=1e-6)


def test_branch_grpo_plans_several_trees_per_prompt():
    cfg = branch_cfg("algorithm.trees_per_prompt=3", "algorithm.split_steps=[0, 3]", "algorithm.group_size=12")
    plan = make_algorithm(cfg).plan(0)
    assert plan.roots_per_prompt == 3 and plan.leaves_per_prompt == 12
    with pytest.raises(Exception, match="= 3 x 2\\^2 = 12"):
        branch_cfg("algorithm.trees_per_prompt=3", "algorithm.split_steps=[0, 3]", "algorithm.group_size=4")


def test_weighted_fusions_by_hand():
    # edge log-probs: round 1 (0, -1); round 2 (0, ln 3, 0, 0)
    tree = tree_skeleton([[0, 0], [0, 0, 1, 1]], log_probs=[[0.0, -1.0], [0.0, math.log(3), 0.0, 0.0]])
    r = torch.tensor([1.0, 3.0, -2.0, 0.0])
    path = trees.fuse_rewards(tree, r, "path_weighted", beta=1.0)
    assert path[1].tolist() == pytest.approx([(1 + 3 * 3) / 4, -1.0])
    e = math.exp(-1)  # path weights exp(cum log-prob) of the leaves: 1, 3, e^-1, e^-1
    assert float(path[0][0]) == pytest.approx((1 + 9 + e * (-2 + 0)) / (4 + 2 * e))
    code = trees.fuse_rewards(tree, r, "edge_softmax", beta=1.0)
    assert code[1].tolist() == pytest.approx([2.5, -1.0])
    assert float(code[0][0]) == pytest.approx((2.5 - e) / (1 + e))  # softmax over the root's child edges only
    assert trees.fuse_rewards(tree, r, "path_weighted", beta=0.0)[0].tolist() == [0.5]


def test_equal_rewards_give_zero_advantages_without_nan():
    tree = tree_skeleton([[0, 0], [0, 0, 1, 1]])
    values = trees.fuse_rewards(tree, torch.full((4,), 0.25))
    adv, stats = trees.depth_advantages(tree, values)
    assert all(torch.isfinite(a).all() and (a == 0).all() for a in adv)
    assert stats["depth_groups_zero_std"] == 2


def test_nan_leaf_is_left_out_of_fusion():
    tree = tree_skeleton([[0, 0], [0, 0, 1, 1]])
    values = trees.fuse_rewards(tree, torch.tensor([1.0, float("nan"), -2.0, 0.0]))
    assert values[1].tolist() == [1.0, -1.0]


# ------------------------------------------------------------------------------------------- sibling noise
def test_correlated_sibling_noise_is_marginal_preserving():
    s = 2.0
    eps = sibling_noise((40000, 2), 2, "correlated", s, torch.Generator().manual_seed(0)).view(20000, 2, 2)
    assert eps.var().item() == pytest.approx(1.0, abs=0.03)
    corr = torch.corrcoef(torch.stack([eps[:, 0, 0], eps[:, 1, 0]]))[0, 1].item()
    assert corr == pytest.approx(1 / (1 + s**2), abs=0.03)
    scaled = sibling_noise((40000, 2), 2, "scaled", 4.0, torch.Generator().manual_seed(0))
    assert scaled.std().item() == pytest.approx(4.0, rel=0.03)
    mirrored = sibling_noise((40000, 2), 4, "antithetic", 0.0, torch.Generator().manual_seed(0)).view(10000, 4, 2)
    assert torch.equal(mirrored[:, 2:], -mirrored[:, :2])  # sibling b + 2 = -sibling b, exactly
    assert mirrored.var().item() == pytest.approx(1.0, abs=0.03)  # each child still N(0, I)
    corr = torch.corrcoef(torch.stack([mirrored[:, 0, 0], mirrored[:, 1, 0]]))[0, 1].item()
    assert abs(corr) < 0.03  # the two halves' own draws are independent


# ------------------------------------------------------------------------------------------- E-GRPO
def test_entropy_merge_rule_matches_the_spec_numbers():
    sig = static_shift_sigmas(16, 3.0)
    e1 = [step_entropy_score(sig, i, 1, 0.7, "exp_entropy_per_dim") for i in range(8)]
    # i = 0: the transition std there is exactly a, so E = sqrt(2 pi e) a = 2.893 (the spec's 2.89)
    assert e1[0] == pytest.approx(math.sqrt(2 * math.pi * math.e) * 0.7, rel=1e-5)
    assert e1 == pytest.approx([2.89, 2.99, 2.14, 1.76, 1.54, 1.39, 1.28, 1.19], abs=0.006)
    steps = list(range(8))
    assert entropy_merge_lengths(sig, steps, 0.7, 2.2, "exp_entropy_per_dim") == [1, 1, 2, 2, 2, 3, 3, 3]
    assert entropy_merge_lengths(sig, steps, 0.7, 2.2, "variance") == [1, 1, 1, 1, 1, 2, 2, 2]
    assert entropy_merge_lengths(sig, steps, 0.7, 2.2, "log_variance") == [2, 2, 2, 3, 4, 4, 5, 5]


def test_side_branch_accounting():
    cfg = load_config(ROOT / "configs/tiny_tempflow_grpo.yaml")
    plan = make_algorithm(cfg).plan(0)
    k, seeds = cfg.algorithm.group_size, cfg.algorithm.seeds
    # per seed: 9 main evaluations, and a branch from step k costs T - k - 1 completion evaluations
    assert plan.counts() == {**plan.counts(), "leaves": seeds * 9 * k, "trained_edges": seeds * 9 * k,
                             "nfe": seeds * (9 + k * sum(9 - i for i in range(9)))}
    eg = load_config(ROOT / "configs/tiny_e_grpo.yaml")
    plan = make_algorithm(eg).plan(0, sigmas=static_shift_sigmas(16, 3.0))
    assert plan.notes["merge_lengths"] == [1, 1, 2, 2, 2, 3, 3, 3]
    assert plan.counts()["nfe"] == 8 + 6 * sum(16 - i - l for i, l in enumerate([1, 1, 2, 2, 2, 3, 3, 3]))


# ------------------------------------------------------------------------------------------- reductions
def _tree_and_adv(cfg, adapter, seed=0):
    from flowrl.sampling import sigmas_for

    sig = sigmas_for(cfg, adapter, cfg.sampler.num_steps)
    plan = make_algorithm(cfg).plan(0, sigmas=sig)
    cond = adapter.encode_prompts(["a red circle", "a blue square"])
    tree = rollout(adapter, cond, plan, sig, (3, 16, 16), kernel=cfg.sampler.kernel, noise_level=cfg.sampler.noise_level,
                   generator=torch.Generator().manual_seed(seed))
    rewards = tree.leaves.mean(dim=(1, 2, 3))
    adv, keep, _ = make_algorithm(cfg).advantages(tree, rewards, 0)
    return plan, tree, adv


def test_branch_without_splits_is_dance_grpo(tiny_adapter):
    common = ["sampler.num_steps=6", "algorithm.group_size=4", "advantage.eps=0.0", "advantage.ddof=1"]
    branch = branch_cfg(*common, "algorithm.split_steps=[0]", "algorithm.branch_factor=4",
                        "algorithm.sibling_noise=independent")
    dance = load_config(ROOT / "configs/tiny_dance_grpo.yaml", [*common, "algorithm.timestep_selection=first"])
    pb, tb, ab = _tree_and_adv(branch, tiny_adapter)
    pd, td, ad = _tree_and_adv(dance, tiny_adapter)
    assert [s.branch for s in pb.steps] == [s.branch for s in pd.steps] and pb.roots_per_prompt == pd.roots_per_prompt
    assert torch.equal(tb.leaves, td.leaves)
    # every depth holds the 4 chains of one tree, so the depth z-score is the group z-score of the leaves
    for r in range(1, 7):
        assert torch.allclose(ab[r], ad[r], atol=1e-5), r


def test_egrpo_with_unit_merges_is_tempflow_branching(tiny_adapter):
    common = ["sampler.num_steps=6", "sampler.schedule=static_shift", "algorithm.group_size=3",
              "algorithm.steps=[0,1,2]", "algorithm.seeds=1"]
    eg = load_config(ROOT / "configs/tiny_e_grpo.yaml", [*common, "algorithm.merge=list",
                                                            "algorithm.merge_lengths=[1,1,1]", "advantage.ddof=0"])
    tf = load_config(ROOT / "configs/tiny_tempflow_grpo.yaml", [*common, "advantage.ddof=0", "advantage.eps=1.0e-8"])
    pe, te, ae = _tree_and_adv(eg, tiny_adapter)
    pt, tt, at = _tree_and_adv(tf, tiny_adapter)
    assert pe.describe() == pt.describe()
    assert torch.equal(te.leaves, tt.leaves) and torch.equal(te.leaf_lineage, tt.leaf_lineage)
    for r in range(1, te.num_rounds + 1):
        assert torch.allclose(ae[r], at[r]), r


def test_merged_side_step_lands_on_the_right_sigma(tiny_adapter):
    cfg = load_config(ROOT / "configs/tiny_e_grpo.yaml", ["sampler.num_steps=6", "algorithm.steps=[1]",
                                                         "algorithm.merge=list", "algorithm.merge_lengths=[3]"])
    plan, tree, adv = _tree_and_adv(cfg, tiny_adapter)
    # round 2 holds the 6 side children per prompt at index 1 + 3; they reach T = 6 two rounds later
    side = tree.lineage[2] == 1
    assert tree.index[2][side].unique().tolist() == [4]
    assert tree.num_rounds == 4 and tree.leaves.shape[0] == 2 * 6
    assert tree.nfe == 2 * (2 + 6 * 2)  # anchor at indices 0, 1; each side child at indices 4, 5
    # each advantage group is one (prompt, step): 6 leaves, zero mean
    a = adv[2][side]
    assert torch.allclose(a.view(2, 6).mean(dim=1), torch.zeros(2), atol=1e-5)


# ------------------------------------------------------------------------------------------- training
def _iteration(tmp_path, name, *overrides):
    from flowrl.trainer import Trainer

    cfg = load_config(ROOT / "configs" / name, [f"log.output_dir={tmp_path}", "log.run_name=t", "log.progress=false",
                                                "log.sample_every=0", "log.save_every=0", "train.prompts_per_iter=1",
                                                "train.num_minibatches=1", *overrides])
    return Trainer(cfg).iteration(0)


def test_branch_iteration_trains_each_parent_once(tmp_path):
    row = _iteration(tmp_path, "tiny_branch_grpo.yaml", "algorithm.width_pruning=parent_top1")
    assert row["nfe_rollout"] == 203 and row["leaves"] == 16
    assert row["trained_edges"] == 138 and row["pruned_edges"] == 80
    assert row["nfe_train"] == 43 + 80  # distinct parents of the kept edges
    assert row["ratio_max_abs_dev_first_update"] < 1e-5


def test_side_branch_iterations_evaluate_the_shared_state_once(tmp_path):
    row = _iteration(tmp_path / "tf", "tiny_tempflow_grpo.yaml")
    # 2 seeds x 9 active steps x 4 branches; each main state is evaluated once for its 4 edges
    assert row["trained_edges"] == 72 and row["nfe_train"] == 18
    assert row["ratio_max_abs_dev_first_update"] < 1e-5
    row = _iteration(tmp_path / "eg", "tiny_e_grpo.yaml")
    assert row["trained_edges"] == 48 and row["nfe_train"] == 8
    assert row["ratio_max_abs_dev_first_update"] < 1e-5


def test_noise_aware_weights_average_one(tmp_path):
    from flowrl.trainer import Trainer

    cfg = load_config(ROOT / "configs/tiny_tempflow_grpo.yaml", [f"log.output_dir={tmp_path}", "log.progress=false"])
    trainer = Trainer(cfg)
    plan = make_algorithm(cfg).plan(0, sigmas=trainer.sigmas)
    cond = trainer.adapter.encode_prompts(["a cat"])
    tree = rollout(trainer.adapter, cond, plan, trainer.sigmas, trainer.latent_shape, kernel="flow_grpo",
                   noise_level=0.7, generator=torch.Generator().manual_seed(0))
    w = trainer.algorithm.loss_weights(tree, tree.trained)
    assert sorted(w) == list(range(9)) and sum(w.values()) / 9 == pytest.approx(1.0)
    sig = trainer.sigmas.double()
    s_r = torch.where(sig[:9] >= 1, sig[1], sig[:9])
    expect = 0.7 * torch.sqrt(sig[:9] / (1 - s_r)) * torch.sqrt(sig[:9] - sig[1:10])  # sigma_t sqrt(dt), sigma_1 below only
    assert [w[i] for i in range(9)] == pytest.approx((expect / expect.mean()).tolist(), rel=1e-4)
    trainer.algorithm.opts.loss_weight = "scaled_std"  # the released code's 2.25 sigma_t sqrt(dt)
    w = trainer.algorithm.loss_weights(tree, tree.trained)
    assert [w[i] for i in range(9)] == pytest.approx((2.25 * expect).tolist(), rel=1e-4)
    # SD3's 10-step grid (diffusers: linspace(1, 1/1000, 10) shifted by 3, then 0) at a = 0.7: the scaled weights
    # of the 9 steps Flow-GRPO trains average 0.999
    t = torch.linspace(1, 0.001, 10).double()
    sd3 = torch.cat([3 * t / (1 + 2 * t), torch.zeros(1, dtype=torch.float64)])
    s_r = torch.where(sd3[:9] >= 1, sd3[1], sd3[:9])
    std = 0.7 * torch.sqrt(sd3[:9] / (1 - s_r)) * torch.sqrt(sd3[:9] - sd3[1:10])
    assert float((2.25 * std).mean()) == pytest.approx(0.999, abs=5e-4)


def test_multi_granularity_completion(tiny_adapter):
    cfg = load_config(ROOT / "configs/tiny_e_grpo.yaml", ["sampler.num_steps=6", "algorithm.steps=[0,1]",
                                                         "algorithm.merge=list", "algorithm.merge_lengths=[1,2]",
                                                         "algorithm.group_size=3", "algorithm.granularities=[1,2]"])
    plan, tree, adv = _tree_and_adv(cfg, tiny_adapter)
    # a side child landing at j is finished by a stride-1 chain (6 - j steps) and a stride-2 chain (ceil((6 - j)/2))
    c = plan.counts()
    assert c["leaves"] == 3 * 2 + 3 * 2
    assert c["edges"] == 3 * (1 + 5 + 3) + 3 * (1 + 3 + 2) + 1  # + the anchor's one ODE step
    assert tree.leaves.shape[0] == 2 * c["leaves"] and tree.nfe == 2 * c["nfe"] and sum(x.shape[0] for x in tree.latents[1:]) == 2 * c["edges"]
    assert sorted(tree.leaf_stride.unique().tolist()) == [1, 2]
    # the SDE edge's advantage is the sum of its two completions' group advantages
    from flowrl.advantages import group_advantages
    from flowrl.algorithms import make_algorithm

    rewards = tree.leaves.mean(dim=(1, 2, 3))
    a_leaf, _ = group_advantages(rewards, make_algorithm(cfg).leaf_groups(tree), cfg.advantage)
    sde = torch.nonzero(tree.trained[1]).flatten()
    vals = tree.per_node(a_leaf)  # summed up the tree: the sum of the leaf advantages below each node
    for r in range(tree.num_rounds, 1, -1):
        vals[r - 1].index_add_(0, tree.parent[r], vals[r])
    assert torch.allclose(adv[1][sde], vals[1][sde].float(), atol=1e-5)
