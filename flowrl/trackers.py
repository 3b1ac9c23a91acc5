"""Per-prompt and global reward statistics that outlive one iteration (SuperFlow, AdaGRPO, zero-variance policy).

- :class:`BetaTracker`: SuperFlow's (SPO's) per-prompt Beta posterior of a reward normalised to [0, 1]:
  on each visit ``alpha <- rho alpha + sum r``, ``beta <- rho beta + sum (1 - r)``, value ``v = alpha / (alpha
  + beta)``, priority ``sqrt(v (1 - v) + eps)``. ``rho`` is constant, or KL-adaptive
  ``clip(2^(-D / D_half), rho_min, 0.96)`` with D the policy's mean |log-prob change| since the last update.
- :class:`CapabilityEMA`: AdaGRPO's EMA of the anchor scores' mean and variance (alpha 0.8; the first
  observation is taken as is).
- :func:`superflow_advantages`, :func:`adagrpo_advantages`, :func:`superflow_group_sizes`: the formulas of
  SuperFlow and AdaGRPO papers, pure functions tested against hand computation.
"""

from __future__ import annotations

import math

import torch


class BetaTracker:
    def __init__(self, rho: float = 0.9, prior: tuple[float, float] = (1.0, 1.0), reward_range: tuple[float, float] = (0.0, 1.0),
                 rho_mode: str = "constant", d_half: float = 0.06, rho_min: float = 0.5, eps: float = 1e-6):
        self.rho, self.prior, self.reward_range = rho, prior, reward_range
        self.rho_mode, self.d_half, self.rho_min, self.eps = rho_mode, d_half, rho_min, eps
        self.state: dict[str, list[float]] = {}

    def normalise(self, rewards: torch.Tensor) -> torch.Tensor:
        lo, hi = self.reward_range
        return ((rewards.double() - lo) / (hi - lo)).clamp(0.0, 1.0)

    def value(self, prompt: str) -> float:
        a, b = self.state.get(prompt, self.prior)
        return a / (a + b)

    def priority(self, prompt: str) -> float:
        v = self.value(prompt)
        return math.sqrt(v * (1 - v) + self.eps)

    def forgetting(self, divergence: float | None = None) -> float:
        if self.rho_mode == "constant" or divergence is None:
            return self.rho
        return min(max(2.0 ** (-divergence / self.d_half), self.rho_min), 0.96)

    def update(self, prompt: str, rewards: torch.Tensor, divergence: float | None = None) -> None:
        """One visit: forget once, then add the group's (finite, normalised) rewards."""
        r = self.normalise(rewards[torch.isfinite(rewards)])
        a, b = self.state.get(prompt, self.prior)
        rho = self.forgetting(divergence)
        self.state[prompt] = [rho * a + float(r.sum()), rho * b + float((1 - r).sum())]

    def state_dict(self) -> dict:
        return {"state": {k: list(v) for k, v in self.state.items()}}

    def load_state_dict(self, d: dict) -> None:
        self.state = {k: list(v) for k, v in d["state"].items()}


class CapabilityEMA:
    def __init__(self, alpha: float = 0.8):
        self.alpha, self.mean, self.var, self.count = alpha, 0.0, 0.0, 0

    def update(self, scores: torch.Tensor) -> None:
        m, v = float(scores.double().mean()), float(scores.double().var(correction=0))
        if self.count == 0:
            self.mean, self.var = m, v
        else:
            self.mean = self.alpha * self.mean + (1 - self.alpha) * m
            self.var = self.alpha * self.var + (1 - self.alpha) * v
        self.count += 1

    def closest(self, scores: torch.Tensor, k: int) -> list[int]:
        """Indices of the k candidates whose anchor score is nearest the current capability."""
        return torch.argsort((scores.double() - self.mean).abs(), stable=True)[:k].tolist()

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, d: dict) -> None:
        self.mean, self.var, self.count = d["mean"], d["var"], d["count"]


def superflow_group_sizes(priorities: list[float], min_size: int, max_size: int, bins: int) -> list[int]:
    """Priority sqrt(v(1-v)) lies in [0, 0.5]: split that range into ``bins`` equal bins; bin k gets
    min + round(k (max - min) / (bins - 1)) samples (an assumption: the paper does not publish its mapping)."""
    out = []
    for w in priorities:
        k = min(bins - 1, int(w / 0.5 * bins)) if bins > 1 else 0
        out.append(min_size + round(k * (max_size - min_size) / max(bins - 1, 1)))
    return out


def superflow_advantages(rewards: torch.Tensor, baselines: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``A = r - v_hat(prompt)`` (both in the tracker's [0, 1] scale), then z-scored over the batch."""
    a = rewards.double() - baselines.double()
    ok = torch.isfinite(a)
    out = torch.zeros_like(a)
    if ok.sum() > 1:
        out[ok] = (a[ok] - a[ok].mean()) / (a[ok].std(correction=0) + eps)
    return out.float()


def adagrpo_advantages(rewards: torch.Tensor, groups: torch.Tensor, ema_mean: float, ema_std: float,
                       clip: float = 5.0, eps: float = 1e-8) -> torch.Tensor:
    """``A = clip(z_intra) + clip(z_global)``: the within-group z-score plus the score against the EMA capability,
    whose positive part is divided by its sum and negative part by its absolute sum (each side sums to +-1);
    if one side is empty the global term is centred instead."""
    r = rewards.double()
    out = torch.zeros_like(r)
    for g in groups.unique().tolist():
        m = groups == g
        x = r[m]
        intra = (x - x.mean()) / (x.std(correction=0) + eps) if x.numel() > 1 else torch.zeros_like(x)
        z = (x - ema_mean) / (ema_std + eps)
        pos, neg = z > 0, z < 0
        if pos.any() and neg.any():
            z = torch.where(pos, z / z[pos].sum(), torch.where(neg, z / z[neg].abs().sum(), z))
        else:
            z = z - z.mean()
        out[m] = intra.clamp(-clip, clip) + z.clamp(-clip, clip)
    return out.float()
