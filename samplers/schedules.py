"""Sigma schedules: T+1 decreasing sigmas from 1 (noise) to 0 (data)."""

from __future__ import annotations

import math

import torch


def shift_sigmas(u: torch.Tensor, shift: float) -> torch.Tensor:
    """Static (SD3) time shift: shift u / (1 + (shift - 1) u)."""
    return shift * u / (1 + (shift - 1) * u)


def static_shift_sigmas(num_steps: int, shift: float = 3.0) -> torch.Tensor:
    """DanceGRPO-lineage grid: shift applied to linspace(1, 0, T + 1). Returns (T+1,) fp32."""
    u = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return shift_sigmas(u, shift).float()


def dynamic_shift_mu(image_seq_len: int, base_seq_len: int = 256, max_seq_len: int = 4096,
                     base_shift: float = 0.5, max_shift: float = 1.15) -> float:
    """Resolution-dependent mu (FLUX / SD3.5 dynamic shifting), linear in the image token count."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * m + (base_shift - m * base_seq_len)


def dynamic_shift_sigmas(num_steps: int, mu: float) -> torch.Tensor:
    """Exponential time shift exp(mu) / (exp(mu) + (1/u - 1)) of linspace(1, 1/T, T), plus a final 0."""
    u = torch.linspace(1.0, 1.0 / num_steps, num_steps, dtype=torch.float64)
    sig = math.exp(mu) / (math.exp(mu) + (1 / u - 1))
    return torch.cat([sig, torch.zeros(1, dtype=torch.float64)]).float()


def diffusers_sigmas(scheduler_config: dict, num_steps: int, mu: float | None = None) -> torch.Tensor:
    """The exact sigmas diffusers' FlowMatchEulerDiscreteScheduler uses for ``num_steps`` (with its final 0)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler.from_config(scheduler_config)
    kwargs = {"mu": mu} if sched.config.get("use_dynamic_shifting", False) else {}
    sched.set_timesteps(num_steps, device="cpu", **kwargs)
    return sched.sigmas.detach().float().clone()


def make_sigmas(kind: str, num_steps: int, shift: float = 3.0, mu: float | None = None,
                scheduler_config: dict | None = None) -> torch.Tensor:
    if kind == "static_shift":
        return static_shift_sigmas(num_steps, shift)
    if kind == "dynamic_shift":
        if mu is None:
            raise ValueError("dynamic_shift needs mu (computed from the image token count)")
        return dynamic_shift_sigmas(num_steps, mu)
    if kind == "diffusers":
        if scheduler_config is None:
            raise ValueError("the diffusers schedule needs the model's scheduler config")
        return diffusers_sigmas(scheduler_config, num_steps, mu)
    raise ValueError(f"unknown sigma schedule {kind!r}; choose diffusers, static_shift or dynamic_shift")
