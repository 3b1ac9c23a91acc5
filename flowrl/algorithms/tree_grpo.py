"""TreeGRPO (arXiv 2512.08153): one shared root per prompt, ODE steps to a window of ``depth`` steps drawn each
iteration, k-way SDE branching at every window step (k ** depth leaves), ODE from there to the leaves; leaf
advantages are the group's z-scores, backed up to every window edge with sibling-softmax weights.

The window start i is drawn from a truncated geometric law on 0..T - depth - 1,
``P(i) = (1 - r) r^i / (1 - r^(T - depth))`` (small r: early windows; r = 1: uniform). Post-order backup from the
last window step up: a node's advantage is ``sum_e softmax_e(log pi_old(e) / temperature) A(e)`` over its child
edges, and the edge into it carries that advantage; a node with one child (an ODE step) passes it up. Every SDE
edge in the window is trained with Flow-GRPO's clipped ratio.

What the paper leaves open is an option here, each with its reading: the log-prob scale inside the softmax
(``softmax_log_prob``: the per-element mean the engine stores, which makes siblings' weights near uniform, or the
sum over the latent's elements, near one-hot), the leaf cap N of its Algorithm 1 (not used: every leaf is kept),
and whether all prompts share one window start (they do here: one plan per iteration).
"""

from __future__ import annotations

import math
import random
from typing import Optional

import torch

from .. import trees
from ..config import opt
from ..errors import ConfigError
from ..samplers import RolloutPlan, StepSpec
from .base import AlgorithmOptions
from .transition import TransitionAlgorithm


class TreeGRPOOptions(AlgorithmOptions):
    group_size: Optional[int] = opt(None, "leaves per prompt; must equal trees_per_prompt x branch_factor ** depth "
                                    "(null: derived)")
    branch_factor: int = opt(3, "k: children of every node at a window step (the paper's default 3)", lo=2)
    depth: int = opt(3, "w = d: the window's steps, where the tree branches (the paper's default 3: 27 leaves)",
                     lo=1)
    window_r: float = opt(0.5, "r of the truncated geometric law of the window start (the paper: 0.5; 0.3 favours "
                          "aesthetics, 0.7 text alignment; 1 = uniform)", lo=0.0, lo_open=True, hi=1.0)
    trees_per_prompt: int = opt(1, "roots per prompt (the paper's ablation: 2); their leaves form one group", lo=1)
    softmax_log_prob: str = opt("mean", "the log-prob inside the sibling softmax: mean over the latent's elements "
                                "(the engine's log-prob; near-uniform weights) or sum over them (near one-hot)",
                                choices=["mean", "sum"])
    temperature: float = opt(1.0, "divides the log-probs inside the sibling softmax", lo=0.0, lo_open=True)


def window_start_law(num_steps: int, depth: int, r: float) -> list[float]:
    """P(i) for i = 0..T - depth - 1: the truncated geometric law of the window start."""
    n = num_steps - depth
    if r >= 1.0:
        return [1.0 / n] * n
    return [(1 - r) * r**i / (1 - r**n) for i in range(n)]


class TreeGRPO(TransitionAlgorithm):
    Options = TreeGRPOOptions

    @classmethod
    def check(cls, cfg) -> None:
        o, t = cfg.algorithm, cfg.sampler.num_steps
        if o.depth >= t:
            raise ConfigError(f"algorithm.depth: a window of {o.depth} steps needs at least {o.depth + 1} "
                              f"denoising steps (sampler.num_steps={t})")
        leaves = o.trees_per_prompt * o.branch_factor ** o.depth
        if o.group_size is not None and o.group_size != leaves:
            raise ConfigError(f"algorithm.group_size ({o.group_size}) must equal trees_per_prompt x branch_factor ** "
                              f"depth = {o.trees_per_prompt} x {o.branch_factor}^{o.depth} = {leaves}; leave it out")

    def window_start(self, rng: random.Random) -> int:
        law = window_start_law(self.cfg.sampler.num_steps, self.opts.depth, self.opts.window_r)
        return rng.choices(range(len(law)), weights=law)[0]

    def plan(self, it: int, rng: random.Random | None = None, sigmas: torch.Tensor | None = None) -> RolloutPlan:
        """ODE to the window, k-way SDE branching at each of its steps (trained), ODE to the leaves."""
        o, t = self.opts, self.cfg.sampler.num_steps
        rng = rng or random.Random(self.cfg.train.seed * 1000003 + it)
        start = self.window_start(rng)
        inside = range(start, start + o.depth)
        steps = [StepSpec(sde=True, branch=o.branch_factor, trained=True, sibling_noise="independent")
                 if i in inside else StepSpec(sde=False, trained=False) for i in range(t)]
        return RolloutPlan(steps, roots_per_prompt=o.trees_per_prompt, notes={"window_start": start})

    def advantages(self, tree, rewards: torch.Tensor, it: int, prompts: list[str] | None = None):
        """Leaf z-scores over the prompt's leaves, backed up the tree with sibling-softmax weights."""
        adv_leaf, stats = self.leaf_advantages(tree, rewards, self.baselines(tree, prompts))
        scale = 1.0 / self.opts.temperature
        if self.opts.softmax_log_prob == "sum":  # the engine stores the mean over the latent's elements
            scale *= math.prod(tree.latents[0].shape[1:])
        node_adv = trees.fuse_rewards(tree, adv_leaf.double(), "edge_softmax", beta=scale)
        keep = [torch.ones(x.shape[0], dtype=torch.bool) for x in tree.latents]
        return [a.float() for a in node_adv], keep, stats
