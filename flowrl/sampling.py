"""ODE sampling with the rollout engine: sample grids, held-out evaluation and anchors. Sits below the
trainer, so evaluation, the CLI and algorithms can draw images without importing it."""

from __future__ import annotations

import resource

import torch

from .engine import rollout
from .errors import ConfigError
from .samplers import RolloutPlan, StepSpec, make_sigmas


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: cuda requested but no CUDA device is available; use device=cpu")
    return torch.device(name)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously), so that a wall clock can time it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def kernel_options(cfg) -> dict:
    """Extra keyword arguments of the configured step kernel (the CPS log-prob convention, low-pass noise): what
    the engine and the objectives pass to :func:`flowrl.samplers.kernels.step`, so neither reads the config."""
    if cfg.sampler.kernel == "cps" and cfg.sampler.cps_log_prob == "published":
        return {"published_log_prob": True}
    if cfg.sampler.noise_lowpass:
        return {"lowpass": cfg.sampler.noise_lowpass, "lowpass_skip_dc": cfg.sampler.noise_lowpass_skip_dc}
    return {}


def check_noise_lowpass(cfg, latent_shape) -> None:
    """``sampler.noise_lowpass`` must fit the latent's height and width: one line otherwise. A latent of packed
    tokens (S, C) has no spatial axes to filter."""
    if cfg.sampler.noise_lowpass and len(latent_shape) < 3:
        raise ConfigError(f"sampler.noise_lowpass={cfg.sampler.noise_lowpass}: this model's latent is a sequence of "
                          f"packed tokens {tuple(latent_shape)}, with no height and width to filter; set "
                          "sampler.noise_lowpass=0")
    most = min(latent_shape[-2:])
    if cfg.sampler.noise_lowpass > most:
        raise ConfigError(f"sampler.noise_lowpass={cfg.sampler.noise_lowpass}: the latent is only "
                          f"{latent_shape[-2]} x {latent_shape[-1]}; use at most {most}")


def sigmas_for(cfg, adapter, num_steps: int) -> torch.Tensor:
    """The (num_steps + 1,) sigma grid: the family pipeline's own (``diffusers``), or a static / dynamic shift."""
    s = cfg.sampler
    if s.schedule == "diffusers":
        return adapter.default_sigmas(num_steps, cfg.model.resolution)
    sched_cfg = adapter.scheduler_config
    mu = None
    if s.schedule == "dynamic_shift" or sched_cfg.get("use_dynamic_shifting", False):
        mu = adapter.shift_mu(num_steps, cfg.model.resolution)
    return make_sigmas(s.schedule, num_steps, shift=s.shift, mu=mu, scheduler_config=sched_cfg)


@torch.no_grad()
def sample_images(adapter, prompts: list[str], seeds: list[int], sigmas: torch.Tensor, latent_shape,
                  guidance_scale: float = 1.0, negative=None, max_batch: int = 64) -> torch.Tensor:
    """ODE samples for every (prompt, seed), row-major by prompt: (P * S, 3, H, W) in [0, 1]."""
    adapter.transformer.eval()
    noise = torch.stack([torch.randn(latent_shape, generator=torch.Generator().manual_seed(s)) for s in seeds])
    noise = noise.repeat(len(prompts), *([1] * len(latent_shape)))  # (P*S, *latent), prompt-major
    cond = adapter.encode_prompts([p for p in prompts for _ in seeds])
    plan = RolloutPlan([StepSpec(sde=False) for _ in range(len(sigmas) - 1)], roots_per_prompt=1)
    tree = rollout(adapter, cond, plan, sigmas, latent_shape, kernel="ode", noise_level=0.0,
                   generator=torch.Generator(), max_batch=max_batch, guidance_scale=guidance_scale,
                   negative=negative, initial_noise=noise)
    return adapter.decode(tree.leaves).cpu()


class Sampler:
    """A model with its sampling settings: ``sampler(prompts, seeds)`` draws ODE images on the evaluation grid
    (``num_steps`` given: that grid instead). What evaluators and grids call."""

    def __init__(self, cfg, adapter, num_steps: int | None = None, guidance_scale: float | None = None):
        self.adapter = adapter
        self.sigmas = sigmas_for(cfg, adapter, num_steps or cfg.sampler.eval_num_steps)
        self.guidance_scale = cfg.sampler.guidance_scale if guidance_scale is None else guidance_scale
        self.negative = adapter.encode_prompts([cfg.sampler.negative_prompt]) if self.guidance_scale > 1 else None
        self.latent_shape = adapter.latent_shape(cfg.model.resolution)
        self.max_batch = cfg.sampler.max_batch
        self.attention_backend = cfg.train.attention_backend

    def __call__(self, prompts: list[str], seeds: list[int]) -> torch.Tensor:
        from .attention import attention_kernels

        with attention_kernels(self.attention_backend):
            return sample_images(self.adapter, prompts, seeds, self.sigmas, self.latent_shape,
                                 self.guidance_scale, self.negative, self.max_batch)
