"""BranchGRPO (arXiv 2509.06040): one root per prompt (or ``trees_per_prompt``) that branches K ways at the split
steps (K ** |B| leaves per tree form the group), every edge trained; leaf rewards are fused up the tree,
advantages are z-scored per (prompt, depth) over the prompt's trees, and width / depth pruning drop gradient work. ``mix``: ODE outside the split steps and the
window (BranchGRPO-Mix). Tree maths: flowrl/trees.py. As its released code, the z-scores use the unbiased std
(``advantage.ddof: 1``) and eps 1e-8 unless a config sets them."""

from __future__ import annotations

import random
from typing import Optional

import torch
from pydantic import Field

from .. import trees
from ..advantages import group_advantages
from ..config import opt
from ..errors import ConfigError
from ..samplers import RolloutPlan, StepSpec
from .base import AlgorithmOptions, WindowOptions, check_steps, window_start
from .transition import TransitionAlgorithm


class BranchGRPOOptions(AlgorithmOptions):
    group_size: Optional[int] = opt(None, "leaves per prompt; must equal trees_per_prompt x branch_factor ** "
                                    "len(split_steps) (null: derived)")
    trees_per_prompt: int = opt(1, "roots per prompt; depth-wise advantages pool the nodes of all of a prompt's "
                                "trees, so K = 2 gives graded advantages instead of a sign", lo=1)
    split_steps: list[int] = opt([0, 3, 6, 9], "step indices where every node branches")
    branch_factor: int = opt(2, "children per node at a split step (K)", lo=2)
    sibling_noise: str = opt("correlated", "correlated: the paper's marginal-preserving sibling noise; scaled: the "
                             "released code (independent noise x strength, log-prob under the unscaled std)",
                             choices=["correlated", "scaled", "independent"])
    sibling_strength: float = opt(4.0, "s of the correlated construction, or the code's noise scale", lo=0.0)
    fusion: str = opt("uniform", "leaf rewards -> node values: uniform mean, the paper's path-probability "
                      "weighting (beta), or the code's recursive child-edge softmax",
                      choices=["uniform", "path_weighted", "edge_softmax"])
    fusion_beta: float = opt(1.0, "beta of path_weighted / edge_softmax fusion")
    width_pruning: str = opt("none", "drop gradient work after the last split",
                             choices=["none", "parent_top1", "extreme", "chain_ratio", "global_ratio"])
    width_ratio: float = opt(0.5, "chain_ratio / global_ratio: fraction of post-split edges kept", lo=0.0, hi=1.0)
    extreme_b: int = opt(0, "extreme: best and worst leaves kept per tree (0 = a quarter of the leaves)", lo=0)
    depth_pruning: list[int] = opt([], "child depths whose edges are not trained at iteration 0 (empty = off)")
    depth_slide_every: int = opt(30, "iterations between moves of the depth window (one depth earlier)", lo=1)
    depth_stop: int = opt(-1, "the window stops when its shallowest depth reaches this (-1 = last split + 1)")
    prune_until: float = opt(1.0, "prune only while iteration < prune_until * train.iterations", lo=0.0, hi=1.0)
    mix: bool = opt(False, "BranchGRPO-Mix: ODE outside split steps and the window; only SDE edges trained")
    window: WindowOptions = Field(default_factory=WindowOptions)


class BranchGRPO(TransitionAlgorithm):
    Options = BranchGRPOOptions
    advantage_defaults = {"ddof": 1, "eps": 1e-8}  # the released code's torch.std and 1e-8

    @classmethod
    def check(cls, cfg) -> None:
        o, t = cfg.algorithm, cfg.sampler.num_steps
        splits = check_steps("algorithm.split_steps", o.split_steps, t)
        leaves = o.trees_per_prompt * o.branch_factor ** len(splits)
        if o.group_size is not None and o.group_size != leaves:
            raise ConfigError(f"algorithm.group_size ({o.group_size}) must equal trees_per_prompt x branch_factor ** "
                              f"len(split_steps) = {o.trees_per_prompt} x {o.branch_factor}^{len(splits)} = {leaves} "
                              f"for branch_grpo; set algorithm.group_size={leaves} or leave it out")
        if o.window.size and not o.mix:
            raise ConfigError("algorithm.window: branch_grpo uses a window only with algorithm.mix=true")

    def plan(self, it: int, rng: random.Random | None = None, sigmas: torch.Tensor | None = None) -> RolloutPlan:
        o, t = self.opts, self.cfg.sampler.num_steps
        rng = rng or random.Random(self.cfg.train.seed * 1000003 + it)
        splits = sorted(o.split_steps)
        notes = {}
        if o.mix:
            start = window_start(o.window, t, it, rng) if o.window.size else 0
            sde = [i in splits or start <= i < start + o.window.size for i in range(t)]
            notes["window_start"] = start
        else:
            sde = [True] * t
        steps = [StepSpec(sde=sde[i], branch=o.branch_factor if i in splits else 1, trained=sde[i],
                          sibling_noise=o.sibling_noise, sibling_strength=o.sibling_strength) for i in range(t)]
        return RolloutPlan(steps, roots_per_prompt=o.trees_per_prompt, notes=notes)

    def advantages(self, tree, rewards: torch.Tensor, it: int, prompts: list[str] | None = None):
        """Fused node values, depth-wise z-scores (clipped), and pruning masks while pruning is on."""
        o, adv_cfg = self.opts, self.cfg.advantage
        _, stats = group_advantages(rewards, tree.leaf_group, adv_cfg)  # leaf-level statistics, for logging
        values = trees.fuse_rewards(tree, rewards, o.fusion, o.fusion_beta)
        adv, depth_stats = trees.depth_advantages(tree, values, adv_cfg.ddof, adv_cfg.eps, adv_cfg.zero_std_threshold)
        adv = [x.clamp(-adv_cfg.clip, adv_cfg.clip) for x in adv]
        stats.update(depth_stats)
        keep = [torch.ones(x.shape[0], dtype=torch.bool) for x in tree.latents]
        if it < o.prune_until * self.cfg.train.iterations:
            last_split = max(o.split_steps)
            keep = trees.width_prune_masks(tree, last_split, o.width_pruning, values, adv, rewards, o.width_ratio,
                                           o.extreme_b)
            stop = last_split + 1 if o.depth_stop < 0 else o.depth_stop
            window = trees.depth_window(o.depth_pruning, it, o.depth_slide_every, stop)
            keep = [k & d for k, d in zip(keep, trees.depth_prune_masks(tree, window))]
            if window:
                stats["depth_window_min"] = min(window)
        if self.cfg.advantage.zero_variance == "drop_refill" and prompts is not None:
            keep = [k & m for k, m in zip(keep, self._refill_masks(tree, rewards, stats))]
        return adv, keep, stats
