"""Reward-filtered online SFT (the peers' "OnlineSFT"): the best samples of each prompt's group (every one tied at the
group's highest reward, as the published rule keeps them) are trained on with the plain flow-matching loss
``mean((v_theta - (eps - x0))^2)`` at the re-noising sigmas, the others not at all (``keep: best``); ``keep: above_mean`` trains every sample that beats its group's mean. It is AWM with the advantage
replaced by a 0 / 1 indicator and the uniform weighting, and serves as a warm start or an anchor."""

from __future__ import annotations

import torch

from ..config import opt
from .awm import AWM, AWMOptions


class SFTOptions(AWMOptions):
    keep: str = opt("best", "best: each group's best samples (all tied at its highest reward); above_mean: every "
                    "sample above its group's mean",
                    choices=["best", "above_mean"])
    weighting: str = opt("uniform", "w(l, sigma); SFT's is the plain error (uniform)",
                         choices=["uniform", "sigma", "sigma2", "huber", "ghuber"])
    time_type: str = opt("logit_normal", "the training sigmas: logit_normal as Flow-GRPO's SFT script (continuous, on "
                         "the training scheduler's timesteps), or AWM's grid strata (discrete_wo_init, discrete)",
                         choices=["logit_normal", "discrete_wo_init", "discrete"])


def keep_indicator(rewards: torch.Tensor, groups: torch.Tensor, keep: str) -> torch.Tensor:
    """(L,) 1.0 for the samples trained on, 0.0 for the rest; NaN rewards are never kept. ``best``: every sample
    at its group's highest reward (ties all kept); ``above_mean``: rewards strictly above their group's mean."""
    out = torch.zeros(rewards.shape[0])
    for g in groups.unique().tolist():
        idx = ((groups == g) & torch.isfinite(rewards)).nonzero().flatten()
        if not len(idx):
            continue
        r = rewards[idx]
        if keep == "best":
            out[idx[r == r.max()]] = 1.0
        else:
            out[idx[r > r.mean()]] = 1.0
    return out


class SFT(AWM):
    """AWM with the advantage replaced by a 0 / 1 keep indicator and the plain (uniform) weighting: a documented
    variant of :class:`~flowrl.algorithms.awm.AWM`."""

    Options = SFTOptions
    variant_of = AWM

    def advantages(self, tree, rewards: torch.Tensor, it: int, prompts: list[str] | None = None):
        """The 0 / 1 keep indicator in place of an advantage (so A_hat = indicator / A_max is rescaled below)."""
        keep_leaf = keep_indicator(rewards, tree.leaf_group, self.opts.keep)
        keep = [torch.ones(x.shape[0], dtype=torch.bool) for x in tree.latents]
        return tree.node_values_from_leaves(keep_leaf), keep, {"sft_kept": float(keep_leaf.sum())}

    def forward_process_loss(self, x0, x_t, t, v_theta, v_old, adv) -> torch.Tensor:
        """Per-sample (B,) ``indicator w(l, sigma)``."""
        return super().forward_process_loss(x0, x_t, t, v_theta, v_old, adv) * self.opts.adv_clip_max
