"""E-GRPO (arXiv 2601.00423): TempFlow's side-branch tree with an ODE anchor, where each active step's K SDE
jumps are *merged* over l_i grid steps, l_i the smallest length whose step entropy reaches tau (or a given
list); active steps default to the first half. ``granularities: [1, 2]`` is G2RPO's multi-granularity
completion from the released code: one ODE finish per stride, each normalised in its own group, summed."""

from __future__ import annotations

import math

import torch

from ..config import opt
from ..errors import ConfigError
from ..samplers.kernels import flow_grpo_noise_scale
from .base import check_steps
from .side_branch import SideBranchAlgorithm, SideOptions


class EGRPOOptions(SideOptions):
    merge: str = opt("adaptive", "merge lengths from the entropy rule (adaptive) or merge_lengths (list)",
                     choices=["adaptive", "list"])
    merge_lengths: list[int] = opt([], "merge=list: one length per active step")
    granularities: list[int] = opt([1], "completion strides; [1, 2] is G2RPO's multi-granularity completion")
    tau: float = opt(2.2, "entropy threshold")
    tau_scale: str = opt("exp_entropy_per_dim", "what tau is compared with: exp(h/d) (default), the variance "
                         "2 pi e s^2, or its log", choices=["exp_entropy_per_dim", "variance", "log_variance"])


def step_entropy_score(sigmas: torch.Tensor, i: int, length: int, noise_level: float, scale: str) -> float:
    """The entropy of the SDE step sigma_i -> sigma_{i+length} on tau's scale. The transition is N(mu, s^2 I),
    s^2 = g(sigma_i)^2 (sigma_i - sigma_{i+l}) with the kernel's g (sigma_1 in the denominator at sigma = 1);
    per dimension h/d = 0.5 log(2 pi e s^2): exp_entropy_per_dim = sqrt(2 pi e s^2), variance = 2 pi e s^2."""
    s = float(sigmas[i])
    v = 2 * math.pi * math.e * flow_grpo_noise_scale(s, float(sigmas[1]), noise_level) ** 2 * (s - float(sigmas[i + length]))
    return {"exp_entropy_per_dim": math.sqrt(v), "variance": v, "log_variance": math.log(v)}[scale]


def entropy_merge_lengths(sigmas: torch.Tensor, steps: list[int], noise_level: float, tau: float, scale: str) -> list[int]:
    """Smallest l per active step whose merged step reaches tau (the longest possible merge when none does)."""
    t = len(sigmas) - 1
    return [next((l for l in range(1, t - i + 1) if step_entropy_score(sigmas, i, l, noise_level, scale) >= tau), t - i)
            for i in steps]


class EGRPO(SideBranchAlgorithm):
    Options = EGRPOOptions

    @classmethod
    def check(cls, cfg) -> None:
        o, t = cfg.algorithm, cfg.sampler.num_steps
        active = check_steps("algorithm.steps", o.steps, t) or cls.default_steps(t)
        if min(o.granularities, default=0) < 1:
            raise ConfigError(f"algorithm.granularities {o.granularities}: give positive strides, e.g. [1] or [1, 2]")
        if o.merge == "list":
            if len(o.merge_lengths) != len(active):
                raise ConfigError(f"algorithm.merge_lengths needs one length per active step ({len(active)}: "
                                  f"{active}), got {len(o.merge_lengths)}")
            for i, l in zip(active, o.merge_lengths):
                if not 1 <= l <= t - i:
                    raise ConfigError(f"algorithm.merge_lengths: step {i} cannot merge {l} steps (1..{t - i})")

    @staticmethod
    def default_steps(t: int) -> list[int]:
        return list(range(max(t // 2, 1)))

    @property
    def granularities(self) -> tuple[int, ...]:
        return tuple(self.opts.granularities)

    def merge_lengths(self, active: list[int], sigmas: torch.Tensor | None) -> list[int]:
        if self.opts.merge == "list":
            return list(self.opts.merge_lengths)
        if sigmas is None:
            raise ValueError("e_grpo's adaptive merge needs the sigma grid")
        return entropy_merge_lengths(sigmas, active, self.cfg.sampler.noise_level, self.opts.tau, self.opts.tau_scale)

    def advantages(self, tree, rewards: torch.Tensor, it: int, prompts: list[str] | None = None):
        adv, keep, stats = super().advantages(tree, rewards, it, prompts)
        if len(self.granularities) > 1:  # G2RPO sums the per-granularity advantages of a side branch
            adv = [x * len(self.granularities) for x in adv]
        return adv, keep, stats
