"""Customized-GRPO (arXiv 2510.18263): two rewards that compete (prompt following r_h, the first reward in
``rewards``, and identity r_d, the second), fused per step instead of summed.

- **Synergy-aware reward shaping (SARS).** A_h and A_d are each reward's group z-score; with p = A_h A_d the bonus is
  ``b = +gamma tanh(p)`` when either advantage is positive, else ``-gamma tanh(p)``: both good is rewarded, a
  conflict (p < 0) and both bad are penalised.
- **Time-aware dynamic weighting (TDW).** At denoising step k the advantage is
  ``clip(w_h(k) A_h + (1 - w_h(k)) A_d + b)`` with w_h = 0.7 for the first 6 of 25 steps, then
  ``0.3 + 0.4 (1 - sigmoid(0.8 (k - 10)))`` up to step 22, then 0.5: prompt following early, identity late. Other
  step counts use the same curve at k 25 / T. The published code evaluates the weight at the position of a shuffled
  step list; here it is the step's true index. ``step_weights: fixed`` keeps w_h at ``fixed_weight``.

Sampling and the update are DanceGRPO's (shared initial noise, a random subset of steps trained per path)."""

from __future__ import annotations

import math

import torch

from ..config import opt
from ..errors import ConfigError
from .dance_grpo import DanceGRPO, DanceGRPOOptions


class CustomizedGRPOOptions(DanceGRPOOptions):
    gamma: float = opt(0.4, "SARS bonus scale (the release's config: 0.4)", lo=0.0)
    step_weights: str = opt("tdw", "tdw (the time-aware schedule) or fixed (w_h = fixed_weight at every step)",
                            choices=["tdw", "fixed"])
    fixed_weight: float = opt(0.7, "step_weights: fixed: the prompt reward's weight w_h", lo=0.0, hi=1.0)


def sars_bonus(a_h: torch.Tensor, a_d: torch.Tensor, gamma: float) -> torch.Tensor:
    """(L,) SARS bonus: +gamma tanh(A_h A_d) when either advantage is positive, -gamma tanh(A_h A_d) otherwise."""
    t = gamma * torch.tanh(a_h * a_d)
    return torch.where((a_h > 0) | (a_d > 0), t, -t)


def tdw_weight(k: int, num_steps: int) -> float:
    """w_h at denoising step k of ``num_steps``: the release's 25-step curve, read at k 25 / num_steps."""
    k25 = k * 25 / num_steps
    if k25 < 6:
        return 0.7
    if k25 < 22:
        return 0.3 + 0.4 * (1 - 1 / (1 + math.exp(-0.8 * (k25 - 10))))
    return 0.5


class CustomizedGRPO(DanceGRPO):
    """DanceGRPO's sampling and update with two rewards fused per step: a documented variant of DanceGRPO."""

    variant_of = DanceGRPO
    Options = CustomizedGRPOOptions

    @classmethod
    def check(cls, cfg) -> None:
        super().check(cfg)
        if len(cfg.rewards) != 2:
            raise ConfigError(f"rewards: customized_grpo fuses exactly two rewards (prompt following first, identity "
                              f"second), not {len(cfg.rewards)}")

    def weight(self, k: int) -> float:
        o = self.opts
        return tdw_weight(k, self.cfg.sampler.num_steps) if o.step_weights == "tdw" else o.fixed_weight

    def reward_advantages(self, tree, scores, weights: dict[str, float], it: int, prompts: list[str] | None = None):
        """Per-step fused advantages on the tree's nodes: the edge into a node created by step k carries
        ``clip(w_h(k) A_h + (1 - w_h(k)) A_d + b)`` of the leaves below it."""
        _, keep, stats = self.advantages(tree, scores.total, it, prompts)
        r_h, r_d = list(scores.components.values())[:2]  # prompt following, identity
        a_h, _ = self.leaf_advantages(tree, torch.where(scores.invalid, torch.nan, r_h), None)
        a_d, _ = self.leaf_advantages(tree, torch.where(scores.invalid, torch.nan, r_d), None)
        a_h, a_d = a_h.float(), a_d.float()
        bonus = sars_bonus(a_h, a_d, self.opts.gamma)
        clip = self.cfg.advantage.clip
        per_step = {}  # step -> per-round node values
        node_adv = [torch.zeros(len(i)) for i in tree.index]
        for r in range(1, len(tree.index)):
            steps = (tree.index[r] - 1).tolist()  # the step that created each node of round r (ordinary steps)
            for k in set(steps):
                if k not in per_step:
                    w = self.weight(k)
                    per_step[k] = tree.node_values_from_leaves((w * a_h + (1 - w) * a_d + bonus).clamp(-clip, clip))
                m = torch.tensor([s == k for s in steps])
                node_adv[r][m] = per_step[k][r][m].float()
        stats.update({"sars_bonus_mean": float(bonus.mean()),
                      "sars_conflicts": float(((a_h > 0) != (a_d > 0)).float().mean())})
        return node_adv, keep, stats
