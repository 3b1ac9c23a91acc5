"""Policy-gradient losses on per-edge log-probs."""

from __future__ import annotations

import torch


def ppo_clip_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                  clip_range: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-edge clipped surrogate ``max(-A r, -A clip(r, 1 - eps, 1 + eps))`` with ``r = exp(logp - logp_old)``.

    All inputs are (E,); returns (loss (E,), ratio (E,)).
    """
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.maximum(unclipped, clipped), ratio


def gaussian_kl_same_std(mean: torch.Tensor, mean_ref: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL(N(mean, s^2) || N(mean_ref, s^2)) per element averaged over non-batch dims -> (E,).

    ``std`` is the transition's full std (including sqrt(|dt|)) by default; :func:`kl_std` gives Flow-GRPO's
    SD3 normalisation, which omits the dt factor (spec/anchors.md, issue #78), so its beta is |dt| times ours.
    """
    kl = (mean - mean_ref) ** 2 / (2 * std**2)
    return kl.mean(dim=tuple(range(1, kl.ndim)))


def kl_std(mode: str, std: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor) -> torch.Tensor:
    """The std the KL divides by: ``transition`` = the full transition std; ``flow_grpo`` = the std without its
    sqrt(|dt|) factor (Flow-GRPO's form, so published beta values carry over). sigma, sigma_next: (B,)."""
    if mode == "transition":
        return std
    dt = (sigma - sigma_next).abs().float().reshape(-1, *([1] * (std.ndim - 1)))
    return std / dt.sqrt()


def guard_log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor, mean: torch.Tensor, old_mean: torch.Tensor,
                    std: torch.Tensor) -> torch.Tensor:
    """GRPO-Guard's normalised log-ratio per edge (E,): ``(logp - logp_old + bias) * s`` with
    ``bias = mean((mu - mu_old)^2) / (2 s^2)`` and ``s`` the edge's transition std.

    With the sample ``x' = mu_old + s eps`` and per-element-mean log-probs this equals ``mean((mu - mu_old) eps)``:
    centred at 0 whatever the step, where the plain log-ratio is biased below 0 by ``bias`` (most at low noise).
    ``bias`` is per edge here (the maths' form); the anchor's script reduces it over the batch (spec/anchors.md 2.4).
    mean, old_mean: (E, *latent); std: (E, *latent) or broadcastable; log-probs (E,).
    """
    n = mean.shape[0]
    s = std.expand_as(mean).reshape(n, -1).mean(1)  # (E,) the transition std (one value per edge for Flow-SDE)
    bias = ((mean - old_mean) ** 2).reshape(n, -1).mean(1) / (2 * s**2)
    return (log_prob - old_log_prob + bias) * s
