"""TempFlow-GRPO (arXiv 2508.04324): per initial noise an ODE main line; at every active step K one-step
SDE side branches, each completed by ODE and scored; one advantage group per (prompt or seed, active step),
so credit lands on the step that branched; each step's loss weighted by its transition std sigma_t sqrt(dt),
times 2.25 as in the released code (``scaled_std``: mean 0.999 over SD3's 10-step grid at a = 0.7) or normalised
to mean 1 over the trained steps (``noise_aware``). E-GRPO and AdaGRPO reuse this side-branch tree (their modules subclass this one)."""

from __future__ import annotations

import random

import torch

from ..config import AlgorithmOptions, opt
from ..samplers import RolloutPlan, StepSpec
from .base import check_steps
from .flow_grpo import FlowGRPO


class SideOptions(AlgorithmOptions):
    group_size: int = opt(4, "side branches per active step and main line", lo=2)
    steps: list[int] = opt([], "active steps (empty: the algorithm's default set)")
    seeds: int = opt(1, "main lines (initial noises) per prompt", lo=1)
    group_by: str = opt("prompt", "advantage group per active step: all main lines of the prompt (released TempFlow "
                        "code, E-GRPO) or one main line's branches (TempFlow paper)", choices=["prompt", "seed"])


class TempFlowOptions(SideOptions):
    loss_weight: str = opt("scaled_std", "per-step loss weight: scaled_std (2.25 sigma_t sqrt(dt), the released "
                           "code), noise_aware (sigma_t sqrt(dt) over its mean across the trained steps) or none",
                           choices=["scaled_std", "noise_aware", "none"])


class TempFlowGRPO(FlowGRPO):
    Options = TempFlowOptions

    @classmethod
    def check(cls, cfg) -> None:
        check_steps("algorithm.steps", cfg.algorithm.steps, cfg.sampler.num_steps)

    # ------------------------------------------------------------------ the side-branch tree (shared)
    @staticmethod
    def default_steps(t: int) -> list[int]:
        return list(range(max(t - 1, 1)))  # every step but the last

    def active_steps(self) -> list[int]:
        t = self.cfg.sampler.num_steps
        return sorted(self.opts.steps) if self.opts.steps else self.default_steps(t)

    def merge_lengths(self, active: list[int], sigmas: torch.Tensor | None) -> list[int]:
        """Grid indices each side jump spans (1 = an ordinary step)."""
        return [1] * len(active)

    granularities: tuple[int, ...] = (1,)

    def plan(self, it: int, rng: random.Random | None = None, sigmas: torch.Tensor | None = None) -> RolloutPlan:
        t = self.cfg.sampler.num_steps
        active = self.active_steps()
        merges = self.merge_lengths(active, sigmas)
        steps = []
        for i in range(t):
            k = active.index(i) if i in active else -1
            steps.append(StepSpec(sde=False, branch=0 if i == active[-1] else 1, trained=False,
                                  side=self.opts.group_size if k >= 0 else 0, side_merge=merges[k] if k >= 0 else 1,
                                  side_granularities=tuple(self.granularities)))
        return RolloutPlan(steps, roots_per_prompt=self.opts.seeds, notes={"active_steps": active, "merge_lengths": merges})

    def leaf_groups(self, tree) -> torch.Tensor:
        """One group per (prompt or main line, active step, completion stride)."""
        owner = tree.leaf_group if self.opts.group_by == "prompt" else tree.leaf_root
        key = (owner * (tree.num_steps + 1) + tree.leaf_lineage + 1) * (tree.num_steps + 1) + tree.leaf_stride
        return torch.unique(key, return_inverse=True)[1]

    # ------------------------------------------------------------------ TempFlow's own difference
    def loss_weights(self, tree, masks) -> dict[int, float] | None:
        """Each trained step's transition std sigma_t sqrt(dt), times 2.25 (``scaled_std``) or over its mean across
        the trained steps (``noise_aware``)."""
        if self.opts.loss_weight == "none":
            return None
        per_step: dict[int, float] = {}
        for r in range(1, tree.num_rounds + 1):
            for c in torch.nonzero(masks[r]).flatten().tolist():
                per_step.setdefault(int(tree.index[r - 1][tree.parent[r][c]]), float(tree.std[r][c]))
        if self.opts.loss_weight == "scaled_std":
            return {k: 2.25 * v for k, v in per_step.items()}
        mean = sum(per_step.values()) / max(len(per_step), 1)
        return {k: v / mean for k, v in per_step.items()} if mean > 0 else {k: 1.0 for k in per_step}
