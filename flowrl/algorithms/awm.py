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
from .base import GroupOptions
from .diffusion_nft import DiffusionNFT


class AWMOptions(GroupOptions):
    timesteps_per_sample: int = opt(6, "training sigmas per sample (one per stratum of the rollout grid)", lo=1)
    time_type: str = opt("discrete_wo_init", "the strata of grid indices: discrete_wo_init from index 1 (the code's "
                         "GenEval and OCR setting), discrete from index 0 (its PickScore setting); both end before "
                         "int(0.9 T)", choices=["discrete_wo_init", "discrete"])
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


def stratified_indices(num_steps: int, k: int, gen: torch.Generator, start: int = 1) -> torch.Tensor:
    """(k,) grid indices as the published code draws them: boundaries ``linspace(start, int(0.9 T), k + 1)``
    truncated to integers, then ``lower + floor(u (upper - lower))`` with u uniform in [0, 1) per stratum (the upper
    bound excluded; a stratum of width 0 gives its lower bound)."""
    bounds = torch.linspace(start, int(num_steps * 0.9), k + 1)  # float32, as the code computes them
    lower, upper = bounds[:-1].long(), bounds[1:].long()
    return lower + (torch.rand(k, generator=gen) * (upper - lower)).long()


def logit_normal_sigmas(n: int, k: int, shift: float, gen: torch.Generator, train_timesteps: int = 1000):
    """(n, k) sigmas as Flow-GRPO's DPO and SFT scripts draw them: u = sigmoid(N(0, 1)), the index floor(u N) into
    the training scheduler's N timesteps (N - i at index i), and that timestep's sigma after the family's shift,
    ``shift s / (1 + (shift - 1) s)`` with s = (N - i) / N."""
    u = torch.sigmoid(torch.randn(n, k, generator=gen, dtype=torch.float64))
    index = (u * train_timesteps).long().clamp(max=train_timesteps - 1)
    s = (train_timesteps - index) / train_timesteps
    return (shift * s / (1 + (shift - 1) * s)).float()


class AWM(DiffusionNFT):
    Options = AWMOptions
    keeps_old_policy = False
    training_shift = 1.0  # the training scheduler's shift (the logit-normal draw), set at attach

    def attach(self, policy, ctx) -> None:
        super().attach(policy, ctx)
        self.training_shift = float(ctx.sample.adapter.scheduler_config.get("shift", 1.0))

    def training_timesteps(self, n: int, sigmas: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """(n, k) sigmas: each sample's own stratified grid sigmas, or logit-normal ones (``time_type``)."""
        if self.opts.time_type == "logit_normal":
            return logit_normal_sigmas(n, self.opts.timesteps_per_sample, self.training_shift, gen)
        start = 1 if self.opts.time_type == "discrete_wo_init" else 0
        idx = torch.stack([stratified_indices(len(sigmas) - 1, self.opts.timesteps_per_sample, gen, start)
                           for _ in range(n)])
        return sigmas[idx]

    def forward_process_loss(self, x0, x_t, t, v_theta, v_old, adv) -> torch.Tensor:
        """Per-sample (B,) ``A_hat w(l, sigma)``: x0, x_t, v: (B, *latent); t, adv: (B,)."""
        tt = t.view(-1, *([1] * (x0.ndim - 1)))
        eps = (x_t - (1 - tt) * x0) / tt  # the noise this sample was re-noised with
        l = ((v_theta.float() - (eps - x0)) ** 2).flatten(1).mean(1)
        a_max = self.opts.adv_clip_max
        return adv.clamp(-a_max, a_max) / a_max * matching_weight(l, t, self.opts.weighting, self.opts.ghuber_power)

    def old_decay(self, it: int) -> float:
        return 0.0
