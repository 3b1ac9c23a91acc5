"""Step kernels for rectified-flow sampling, as pure functions of tensors.

Conventions: ``x = (1 - sigma) x0 + sigma eps``, ``v = eps - x0``, sampling runs from
sigma = 1 (noise) to sigma = 0 (data), ``dt = sigma_next - sigma < 0``.

Every kernel computes in fp32 and returns a :class:`StepOutput` with
- ``sample``: the next latent (drawn with ``noise`` or equal to the given ``prev_sample``),
- ``mean`` and ``std``: the Gaussian transition ``N(mean, std^2)``; ``std`` is the *full* per-step std,
  i.e. it already includes ``sqrt(|dt|)`` where the SDE has one,
- ``log_prob``: log N(sample; mean, std^2) averaged over all non-batch elements (the anchors' convention,
  which sets the tiny PPO clip ranges), shape (B,). ODE steps have no density and return zeros.

``sigma`` and ``sigma_next`` may be Python floats or per-sample tensors of shape (B,).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


@dataclass
class StepOutput:
    sample: torch.Tensor  # (B, C, H, W) fp32
    mean: torch.Tensor  # (B, C, H, W) fp32
    std: torch.Tensor  # broadcastable to sample, fp32; 0 for ODE steps
    log_prob: torch.Tensor  # (B,) fp32


def _as_batch(value, x: torch.Tensor) -> torch.Tensor:
    """A scalar or (B,) tensor reshaped to (B, 1, 1, ...) in fp32 on x's device."""
    if isinstance(value, (int, float)):  # filled on the device: a scalar copied from the host would synchronise it
        return torch.full((x.shape[0],) + (1,) * (x.ndim - 1), float(value), dtype=torch.float32, device=x.device)
    t = torch.as_tensor(value, dtype=torch.float32, device=x.device)
    if t.ndim == 0:
        t = t.expand(x.shape[0])
    return t.reshape(-1, *([1] * (x.ndim - 1)))


def gaussian_log_prob(sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, reduce: str = "mean") -> torch.Tensor:
    """Gaussian log-density of ``sample`` per element, reduced over non-batch dims -> (B,)."""
    std = std.expand_as(mean) if std.shape != mean.shape else std
    lp = -((sample.detach() - mean) ** 2) / (2 * std**2) - torch.log(std) - LOG_SQRT_2PI
    dims = tuple(range(1, lp.ndim))
    return lp.mean(dim=dims) if reduce == "mean" else lp.sum(dim=dims)


def _finish(mean, std, noise, prev_sample, reduce="mean") -> StepOutput:
    if prev_sample is None:
        if noise is None:
            raise ValueError("an SDE step needs either `noise` (to sample) or `prev_sample` (to score)")
        sample = mean + std * noise.float()
    else:
        sample = prev_sample.float()
    return StepOutput(sample, mean, std, gaussian_log_prob(sample, mean, std, reduce))


@lru_cache(maxsize=16)
def dct_lowpass_basis(size: int, k: int, device: str = "cpu") -> torch.Tensor:
    """The k lowest-frequency orthonormal DCT-II vectors on ``size`` points, as rows: (k, size) fp32."""
    if not 1 <= k <= size:
        raise ValueError(f"noise_lowpass={k} must lie in 1..{size}, the latent's side")
    i = torch.arange(size, dtype=torch.float64)
    f = torch.arange(k, dtype=torch.float64)[:, None]
    basis = torch.cos(math.pi * (i + 0.5) * f / size) * math.sqrt(2.0 / size)
    basis[0] /= math.sqrt(2.0)
    return basis.float().to(device)


def lowpass_coords(x: torch.Tensor, k: int, skip_dc: bool = False) -> torch.Tensor:
    """Coordinates of x in the k x k lowest spatial DCT frequencies of its last two axes, flattened:
    (..., H, W) -> (..., k * k), or (..., k * k - 1) without the constant (0, 0) term when ``skip_dc``."""
    bh = dct_lowpass_basis(x.shape[-2], k, str(x.device))
    bw = dct_lowpass_basis(x.shape[-1], k, str(x.device))
    coords = torch.einsum("fh,...hw,gw->...fg", bh, x, bw).flatten(-2)
    return coords[..., 1:] if skip_dc else coords


def lowpass_project(x: torch.Tensor, k: int, skip_dc: bool = False) -> torch.Tensor:
    """The orthogonal projection of x onto those frequencies, back on its own grid: (..., H, W) -> (..., H, W)."""
    bh = dct_lowpass_basis(x.shape[-2], k, str(x.device))
    bw = dct_lowpass_basis(x.shape[-1], k, str(x.device))
    coords = torch.einsum("fh,...hw,gw->...fg", bh, x, bw)  # (..., k, k)
    if skip_dc:
        keep = torch.ones(k, k, device=x.device)
        keep[0, 0] = 0.0
        coords = coords * keep
    return torch.einsum("fh,...fg,gw->...hw", bh, coords, bw)


def _finish_lowpass(ode_mean, mean, std, noise, prev_sample, reduce, k, skip_dc) -> StepOutput:
    """The transition restricted to the k x k lowest spatial frequencies (less the constant term with
    ``skip_dc``): there it is the SDE's Gaussian (same drift correction, same std per direction); in every other
    direction it is the ODE step, exactly.

    Why: the policy gradient of a full-rank pixel-space Gaussian pushes the mean along each sample's white
    noise, and the reward only sees its low frequencies; the high-frequency rest averages out only slowly and
    is learnt as texture. Exploring in a low-frequency subspace removes that component from the gradient and
    cuts the action's dimension (k^2 C instead of H W C), so the likelihood-ratio estimate is far less noisy.
    A channel's constant term is a global colour shift, which no shape reward can credit; ``skip_dc`` leaves it
    to the ODE so that it cannot drift into a tint. Marginals are kept: the SDE's score correction is applied in
    exactly the directions that get noise. The log-prob is the Gaussian density of the action's subspace
    coordinates (reduced over the k^2 C of them).
    """
    mean = ode_mean + lowpass_project(mean - ode_mean, k, skip_dc)
    if prev_sample is None:
        if noise is None:
            raise ValueError("an SDE step needs either `noise` (to sample) or `prev_sample` (to score)")
        sample = mean + std * lowpass_project(noise.float(), k, skip_dc)
    else:
        sample = prev_sample.float()
    # the action's coordinates and the mean's: (B, C, [F,] k^2); the log-prob's gradient flows through the mean's
    log_prob = gaussian_log_prob(lowpass_coords(sample.detach(), k, skip_dc), lowpass_coords(mean, k, skip_dc),
                                 std.flatten(-2), reduce)
    return StepOutput(sample, mean, std, log_prob)


def ode_step(x: torch.Tensor, v: torch.Tensor, sigma, sigma_next, **_) -> StepOutput:
    """Deterministic Euler step ``x + dt v`` (the probability-flow ODE)."""
    x, v = x.float(), v.float()
    dt = _as_batch(sigma_next, x) - _as_batch(sigma, x)
    mean = x + dt * v
    zero = torch.zeros_like(dt)
    return StepOutput(mean, mean, zero, torch.zeros(x.shape[0], device=x.device))


def denominator_sigma(sigma: torch.Tensor, sigma_at_one) -> torch.Tensor:
    """sigma_r of Flow-GRPO's g = a sqrt(sigma / (1 - sigma_r)): sigma, or ``sigma_at_one`` where sigma == 1."""
    if sigma_at_one is None:
        return sigma
    if isinstance(sigma_at_one, (int, float)):  # a Python number enters the kernel as an argument, not a copy
        return torch.where(sigma >= 1.0, float(sigma_at_one), sigma)
    return torch.where(sigma >= 1.0, torch.as_tensor(sigma_at_one, dtype=sigma.dtype, device=sigma.device), sigma)


def flow_grpo_noise_scale(sigma: float, sigma_at_one: float, noise_level: float) -> float:
    """g(sigma) = a sqrt(sigma / (1 - sigma_r)) for one grid point, as the kernel uses it (no sqrt(dt))."""
    s_r = sigma_at_one if sigma >= 1.0 else sigma
    return noise_level * math.sqrt(sigma / (1 - s_r))


def flow_grpo_sde_step(
    x: torch.Tensor,
    v: torch.Tensor,
    sigma,
    sigma_next,
    noise_level: float = 0.7,
    sigma_at_one=None,
    noise: torch.Tensor | None = None,
    prev_sample: torch.Tensor | None = None,
    reduce: str = "mean",
    lowpass: int = 0,
    lowpass_skip_dc: bool = False,
) -> StepOutput:
    """Flow-GRPO SDE (Euler-Maruyama of the marginal-preserving SDE with g = a sqrt(sigma / (1 - sigma))).

    ``sigma_at_one`` replaces sigma in the *denominator* of sqrt(sigma / (1 - sigma)) when sigma == 1 (the
    anchors use ``sigmas[1]``), avoiding a division by zero at the first step; the numerator keeps the true
    sigma, so the whole transition std at sigma = 1 is a * sqrt(1 / (1 - sigma_1)) * sqrt(1 - sigma_1) = a.
    ``lowpass`` = k > 0 restricts the noise to the k x k lowest spatial frequencies (:func:`_finish_lowpass`).
    """
    x, v = x.float(), v.float()
    s = _as_batch(sigma, x)
    std_dev = noise_level * torch.sqrt(s / (1 - denominator_sigma(s, sigma_at_one)))
    return _flow_sde(x, v, s, _as_batch(sigma_next, x) - s, std_dev, noise, prev_sample, reduce, lowpass,
                     lowpass_skip_dc)


def _flow_sde(x, v, s, dt, std_dev, noise, prev_sample, reduce, lowpass, lowpass_skip_dc) -> StepOutput:
    """The Flow-SDE transition for a diffusion coefficient g = ``std_dev``:
    mean = x (1 + g^2 dt / (2 s)) + v (1 + g^2 (1 - s) / (2 s)) dt, std = g sqrt(-dt)."""
    mean = x * (1 + std_dev**2 / (2 * s) * dt) + v * (1 + std_dev**2 * (1 - s) / (2 * s)) * dt
    std = std_dev * torch.sqrt(-dt)
    if lowpass:
        return _finish_lowpass(x + dt * v, mean, std, noise, prev_sample, reduce, lowpass, lowpass_skip_dc)
    return _finish(mean, std, noise, prev_sample, reduce)


def flash_sde_step(x: torch.Tensor, v: torch.Tensor, sigma, sigma_next, noise_level: float = 1.0, sigma_at_one=None,
                   noise: torch.Tensor | None = None, prev_sample: torch.Tensor | None = None, reduce: str = "mean",
                   lowpass: int = 0, lowpass_skip_dc: bool = False) -> StepOutput:
    """Flash-GRPO's SDE step (arXiv 2605.15980): Flow-GRPO's drift and transition std with the diffusion coefficient
    linear in sigma, sigma_t = a * sigma_1 * sigma (the released code's sigma_min + (sigma_max - sigma_min) sigma with
    sigma_max = sigma_1, the grid's second value, and sigma_min = 0, the last; a = the noise level, 1 there):

    mean = x (1 + sigma_t^2 dt / (2 sigma)) + v (1 + sigma_t^2 (1 - sigma) / (2 sigma)) dt,  std = sigma_t sqrt(-dt).
    ``sigma_at_one`` carries sigma_1 (the engine and the update pass the grid's second value)."""
    if sigma_at_one is None:
        raise ValueError("the flash kernel needs sigma_at_one (the grid's second sigma)")
    x, v = x.float(), v.float()
    s = _as_batch(sigma, x)
    std_dev = noise_level * torch.as_tensor(sigma_at_one, dtype=s.dtype, device=s.device) * s
    return _flow_sde(x, v, s, _as_batch(sigma_next, x) - s, std_dev, noise, prev_sample, reduce, lowpass,
                     lowpass_skip_dc)


def dance_sde_step(
    x: torch.Tensor,
    v: torch.Tensor,
    sigma,
    sigma_next,
    eta: float = 0.3,
    noise: torch.Tensor | None = None,
    prev_sample: torch.Tensor | None = None,
    reduce: str = "mean",
    lowpass: int = 0,
    lowpass_skip_dc: bool = False,
    **_,
) -> StepOutput:
    """DanceGRPO SDE: the same drift as Flow-GRPO's with a constant diffusion coefficient eta.

    mean = x + dt [v + eta^2 / (2 sigma) (x + (1 - sigma) v)],  std = eta sqrt(sigma - sigma_next).
    """
    x, v = x.float(), v.float()
    s = _as_batch(sigma, x)
    dt = _as_batch(sigma_next, x) - s
    score = -(x + (1 - s) * v) / s
    mean = x + dt * v - 0.5 * eta**2 * score * dt
    std = (eta * torch.sqrt(-dt)).clamp_min(1e-8)
    if lowpass:
        return _finish_lowpass(x + dt * v, mean, std, noise, prev_sample, reduce, lowpass, lowpass_skip_dc)
    return _finish(mean, std, noise, prev_sample, reduce)


def cps_step(
    x: torch.Tensor,
    v: torch.Tensor,
    sigma,
    sigma_next,
    noise_level: float = 0.8,
    noise: torch.Tensor | None = None,
    prev_sample: torch.Tensor | None = None,
    reduce: str = "mean",
    published_log_prob: bool = False,
    **_,
) -> StepOutput:
    """Coefficients-preserving sampling (arXiv 2509.05952).

    std = sigma_next sin(a pi / 2) (absolute, no sqrt(dt));
    mean = (1 - sigma_next) x0_hat + sigma_next cos(a pi / 2) x1_hat.
    The log-prob is the true Gaussian one by default. ``published_log_prob=True`` returns the paper's and
    Flow-GRPO's unnormalised ``-(x' - mean)^2`` (mean over elements), whose ratio lives on another scale.
    """
    x, v = x.float(), v.float()
    s = _as_batch(sigma, x)
    s_next = _as_batch(sigma_next, x)
    x0_hat = x - s * v
    x1_hat = x + (1 - s) * v
    std = (s_next * math.sin(noise_level * math.pi / 2)).clamp_min(1e-8)
    mean = x0_hat * (1 - s_next) + x1_hat * s_next * math.cos(noise_level * math.pi / 2)
    out = _finish(mean, std, noise, prev_sample, reduce)
    if published_log_prob:
        sq = -((out.sample.detach() - mean) ** 2)
        dims = tuple(range(1, sq.ndim))
        out.log_prob = sq.mean(dim=dims) if reduce == "mean" else sq.sum(dim=dims)
    return out


KERNELS = {"ode": ode_step, "flow_grpo": flow_grpo_sde_step, "dance": dance_sde_step, "cps": cps_step,
           "flash": flash_sde_step}


def step(kind: str, x, v, sigma, sigma_next, *, noise_level: float, sigma_at_one=None, noise=None,
         prev_sample=None, reduce: str = "mean", published_log_prob: bool = False, lowpass: int = 0,
         lowpass_skip_dc: bool = False) -> StepOutput:
    """Dispatch one transition by kernel name; ``noise_level`` is a for flow_grpo/cps/flash and eta for dance;
    ``lowpass`` (flow_grpo, dance) restricts the noise to that many lowest spatial frequencies per axis
    (``lowpass_skip_dc``: less the constant term)."""
    if kind == "ode":
        return ode_step(x, v, sigma, sigma_next)
    if kind == "flow_grpo":
        return flow_grpo_sde_step(x, v, sigma, sigma_next, noise_level, sigma_at_one, noise, prev_sample, reduce,
                                  lowpass, lowpass_skip_dc)
    if kind == "flash":
        return flash_sde_step(x, v, sigma, sigma_next, noise_level, sigma_at_one, noise, prev_sample, reduce, lowpass,
                              lowpass_skip_dc)
    if kind == "dance":
        return dance_sde_step(x, v, sigma, sigma_next, noise_level, noise, prev_sample, reduce, lowpass,
                              lowpass_skip_dc)
    if kind == "cps":
        return cps_step(x, v, sigma, sigma_next, noise_level, noise, prev_sample, reduce, published_log_prob)
    raise ValueError(f"unknown step kernel {kind!r}; choose one of {sorted(KERNELS)}")
