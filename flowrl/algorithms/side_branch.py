"""Side-branch trees (TempFlow-GRPO's shape, shared by TempFlow-GRPO, E-GRPO and AdaGRPO): per initial noise an
ODE main line; at every active step K SDE side branches (one grid step, or merged over several), each completed by
ODE and scored; one advantage group per (prompt or main line, active step, completion stride), so credit lands on
the step that branched."""

from __future__ import annotations

import random

import torch

from ..config import AlgorithmOptions, opt
from ..samplers import RolloutPlan, StepSpec
from .base import check_steps
from .transition import TransitionAlgorithm


class SideOptions(AlgorithmOptions):
    group_size: int = opt(4, "side branches per active step and main line", lo=2)
    steps: list[int] = opt([], "active steps (empty: the algorithm's default set)")
    seeds: int = opt(1, "main lines (initial noises) per prompt", lo=1)
    group_by: str = opt("prompt", "advantage group per active step: all main lines of the prompt (released TempFlow "
                        "code, E-GRPO) or one main line's branches (TempFlow paper)", choices=["prompt", "seed"])


class SideBranchAlgorithm(TransitionAlgorithm):
    """The side-branch tree on the transition kind: :meth:`plan` and :meth:`leaf_groups` are its own; a method
    chooses its active steps (:meth:`default_steps`), merge lengths and completion strides."""

    Options = SideOptions

    @classmethod
    def kind_checks(cls, cfg) -> None:
        check_steps("algorithm.steps", cfg.algorithm.steps, cfg.sampler.num_steps)

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
