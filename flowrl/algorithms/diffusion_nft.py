"""DiffusionNFT (arXiv 2509.16117): online RL on the forward process. G deterministic (ODE) samples per prompt
are drawn with the *old* policy, scored, and group z-scored; each advantage becomes an optimality probability
``r = clip(A / (2 A_max) + 1/2, 0, 1)``. Training never looks at the sampler's transitions: each clean sample x0
is re-noised at grid timesteps t, ``x_t = (1 - t) x0 + t eps``, and the policy is pulled toward the implicit
positive policy and away from the negative one:

    v+ = beta v_theta + (1 - beta) v_old,   v- = (1 + beta) v_old - beta v_theta
    x0+- = x_t - t v+-,   L+- = mean((x0+- - x0)^2) / w+-,   w+- = mean|x0+- - x0| (detached, >= 1e-5)
    loss = A_max (r L+ + (1 - r) L-) / beta  (+ train.kl_beta mean((v_theta - v_ref)^2))

The old policy is a copy of the trained weights that follows them after every iteration,
``old <- d old + (1 - d) theta`` with ``d = min(0.001 it, 0.5)`` (``old_decay: ramp``) or 0 until iteration 75,
then ``min(0.0075 (it - 75), 0.999)`` (``delayed``). CFG-free: the presets sample with guidance 1.
Values from NVlabs/DiffusionNFT's released code.
"""

from __future__ import annotations

import torch

from ..config import opt
from .base import GroupOptions
from .forward_process import ForwardProcessAlgorithm


class DiffusionNFTOptions(GroupOptions):
    beta: float = opt(1.0, "NFT's guidance strength beta of the implicit policies (the code: 1.0; 0.1 for OCR and "
                      "multi-reward)", lo=0.0, lo_open=True)
    adv_clip_max: float = opt(5.0, "A_max: advantages clipped to +-A_max before r = A / (2 A_max) + 1/2", lo=0.0,
                              lo_open=True)
    timesteps_per_sample: int = opt(2, "grid timesteps each clean sample is re-noised at per update (drawn "
                                    "without replacement from the rollout grid)", lo=1)
    old_decay: str = opt("ramp", "how the old (sampling) policy follows the trained one: ramp = min(0.001 it, "
                         "0.5); delayed = 0 until 75, then min(0.0075 (it - 75), 0.999)", choices=["ramp", "delayed"])


def optimality_probability(adv: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """(B,) advantages -> r in [0, 1]: 1/2 at the group mean, 0 / 1 at -+A_max."""
    return (adv.clamp(-adv_clip_max, adv_clip_max) / (2 * adv_clip_max) + 0.5).clamp(0, 1)


def nft_loss(x0: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor, v_theta: torch.Tensor, v_old: torch.Tensor,
             r: torch.Tensor, beta: float, adv_clip_max: float) -> torch.Tensor:
    """Per-sample DiffusionNFT policy loss (B,). x0, x_t, v: (B, *latent); t, r: (B,)."""
    dims = tuple(range(1, x0.ndim))
    tt = t.view(-1, *([1] * (x0.ndim - 1)))
    v_pos = beta * v_theta + (1 - beta) * v_old
    v_neg = (1 + beta) * v_old - beta * v_theta

    def weighted_error(v):
        err = x_t - tt * v - x0  # x0 prediction minus the clean sample
        w = err.detach().abs().mean(dim=dims, keepdim=True).clamp_min(1e-5)  # adaptive weight, no gradient
        return (err**2 / w).mean(dim=dims)

    return adv_clip_max * (r * weighted_error(v_pos) + (1 - r) * weighted_error(v_neg)) / beta


def old_policy_decay(mode: str, it: int) -> float:
    if mode == "ramp":
        return min(0.001 * it, 0.5)
    return 0.0 if it < 75 else min(0.0075 * (it - 75), 0.999)


class DiffusionNFT(ForwardProcessAlgorithm):
    Options = DiffusionNFTOptions
    keeps_old_policy = True  # rollouts are drawn with the old policy, which follows the trained weights

    def training_timesteps(self, n: int, sigmas: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """(n, k) grid sigmas (the rollout grid without its final 0) at which each sample is re-noised, drawn per
        sample without replacement."""
        grid = sigmas[:-1][sigmas[:-1] > 0]
        k = min(self.opts.timesteps_per_sample, grid.numel())
        idx = torch.stack([torch.randperm(grid.numel(), generator=gen)[:k] for _ in range(n)])
        return grid[idx]

    def forward_process_loss(self, x0, x_t, t, v_theta, v_old, adv) -> torch.Tensor:
        """Per-sample loss (B,) of one re-noised micro-batch (the objective adds the KL term)."""
        r = optimality_probability(adv, self.opts.adv_clip_max)
        return nft_loss(x0, x_t, t, v_theta, v_old, r, self.opts.beta, self.opts.adv_clip_max)

    def old_decay(self, it: int) -> float:
        return old_policy_decay(self.opts.old_decay, it)
