"""AWM, Advantage Weighted Matching (arXiv 2509.25050): the pretraining flow-matching loss, weighted per sample by
its advantage. Rollouts keep only the clean samples x0 (any solver; here ODE, as DiffusionNFT's); each is re-noised
at ``timesteps_per_sample`` grid sigmas, one from each stratum of the rollout grid's indices as the published code
draws them (``time_type: discrete_wo_init``: boundaries ``linspace(1, int(0.9 T), K + 1)`` truncated to whole
indices, each stratum's upper bound excluded, so for T = 14, K = 6 index 1 is always trained and 12 never;
``discrete``: the strata start at index 0, the published PickScore setting), with fresh noise per (sample, sigma).
The published code draws one set of indices per micro-batch of samples; ours draws one per sample. With ``l = mean((v_theta - (eps - x0))^2)`` the loss is

    A_hat w(l, sigma),   A_hat = clip(A, +-A_max) / A_max,

with ``w`` the weighting: ``uniform`` l, ``sigma`` sigma l, ``sigma2`` sigma^2 l, ``huber`` sigma (sqrt(l + 1e-10) -
1e-5), ``ghuber`` (sigma / p)((l + 1e-10)^p - 1e-10^p) with p = ``ghuber_power`` (the default, p = 0.25), plus
``train.kl_beta`` times the velocity MSE to the reference. Its gradient is the official code's (whose ratio of
exp(-w) is 1 on-policy). Defaults from the official code; its KL to a fast EMA is not included."""

from __future__ import annotations

import torch

from ..config import opt
from .forward_process import ForwardProcessAlgorithm, StrataOptions


class AWMOptions(StrataOptions):
    weighting: str = opt("ghuber", "w(l, sigma): uniform, sigma, sigma2, huber or ghuber (the official default)",
                         choices=["uniform", "sigma", "sigma2", "huber", "ghuber"])
    ghuber_power: float = opt(0.25, "ghuber's power p", lo=0.0, lo_open=True, hi=1.0)
    adv_clip_max: float = opt(5.0, "A_max: A_hat = clip(A, +-A_max) / A_max", lo=0.0, lo_open=True)


def matching_weight(l: torch.Tensor, sigma: torch.Tensor, weighting: str, p: float = 0.25) -> torch.Tensor:
    """w(l, sigma) per sample (B,), l the flow-matching error and sigma the noise level, both (B,)."""
    if weighting == "uniform":
        return l
    if weighting == "sigma":
        return sigma * l
    if weighting == "sigma2":
        return sigma ** 2 * l
    if weighting == "huber":
        return sigma * (torch.sqrt(l + 1e-10) - 1e-5)
    return (sigma / p) * ((l + 1e-10) ** p - 1e-10 ** p)


class AWM(ForwardProcessAlgorithm):
    Options = AWMOptions

    def forward_process_loss(self, x0, x_t, t, v_theta, v_old, adv) -> torch.Tensor:
        """Per-sample (B,) ``A_hat w(l, sigma)``: x0, x_t, v: (B, *latent); t, adv: (B,)."""
        tt = t.view(-1, *([1] * (x0.ndim - 1)))
        eps = (x_t - (1 - tt) * x0) / tt  # the noise this sample was re-noised with
        l = ((v_theta.float() - (eps - x0)) ** 2).flatten(1).mean(1)
        a_max = self.opts.adv_clip_max
        return adv.clamp(-a_max, a_max) / a_max * matching_weight(l, t, self.opts.weighting, self.opts.ghuber_power)
