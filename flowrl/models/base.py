"""What the engine, trainer and sampler need of a model: the adapter protocol every family implements.

Latents are (B, *latent_shape): (B, C, H, W) for images, (B, C, F, H, W) for video; the engine, plans, trees,
advantages and updates never look inside them.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class PromptBatch(Protocol):
    """Encoded prompts, one row per prompt; ``embeds`` (N, ...) is what the engine reads the batch size from."""

    embeds: torch.Tensor

    def index(self, idx: torch.Tensor) -> "PromptBatch": ...


@runtime_checkable
class ModelAdapter(Protocol):
    """A model family behind one interface: what the engine, the trainer and the sampler call. Each family
    (``flowrl.models.sd3``, ``flux``, ``flux2``, ``qwenimage``, ``wan``) implements it around its diffusers
    pipeline, with a ``from_config(model_cfg, device)`` constructor."""

    family: str
    transformer: torch.nn.Module  # the trained module (wrapped by accelerate during training)
    device: torch.device
    lora_targets: list[str]  # default peft target modules

    def encode_prompts(self, prompts: list[str]) -> PromptBatch:
        """Encode prompts, each distinct string once (cached), one at a time so that results do not depend on the
        batch's composition.

        Args:
            prompts: N prompts.
        Returns:
            A :class:`PromptBatch` with N rows.
        """

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: PromptBatch, guidance_scale: float = 1.0,
                 negative: PromptBatch | None = None, unconditional_grad: bool = True) -> torch.Tensor:
        """The velocity v(x, sigma | prompt) for a batch of latents at per-sample sigmas.

        Args:
            x: (B, *latent_shape) latents.
            sigma: (B,) noise levels in [0, 1], one per row (rows may differ).
            cond: B rows of encoded prompts.
            guidance_scale: true CFG scale (1 = the conditional velocity only).
            negative: the encoded negative prompt (one row, or B) when guidance_scale > 1.
            unconditional_grad: False: under autograd, the negative prompt's half of CFG is computed without a
                graph (a constant of the result); the same values either way.
        Returns:
            (B, *latent_shape) fp32 velocities.
        """

    def latent_shape(self, resolution: int) -> tuple[int, ...]:
        """Latent shape of one sample (no batch axis)."""

    def image_seq_len(self, resolution: int) -> int:
        """Transformer tokens per sample (dynamic shift)."""

    def shift_mu(self, num_steps: int, resolution: int) -> float:
        """mu of the family's resolution-dependent time shift."""

    def default_sigmas(self, num_steps: int, resolution: int) -> torch.Tensor:
        """The (num_steps + 1,) sigma grid the family's diffusers pipeline uses."""

    @property
    def scheduler_config(self) -> dict:
        """The family's FlowMatchEulerDiscreteScheduler config (shift, dynamic shifting)."""

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode final latents.

        Args:
            latents: (B, *latent_shape).
        Returns:
            Images (B, 3, H, W) or videos (B, F, 3, H, W) in [0, 1], fp32.
        """

    def reference(self) -> AbstractContextManager:
        """The reference policy for the KL term (LoRA disabled) for the duration of the context."""

    def save_lora(self, directory: Path, layers: dict, metadata: dict) -> None:
        """LoRA weights in the family's diffusers format."""


def decode_with_grad(adapter, latents: torch.Tensor) -> torch.Tensor:
    """``adapter.decode`` with its graph kept back to ``latents`` (reward backpropagation and reward-gradient
    guidance differentiate the reward of the decoded image). Every family's ``decode`` runs under
    ``torch.no_grad`` for sampling; this calls the undecorated function under ``torch.enable_grad``."""
    fn = type(adapter).decode
    inner = getattr(fn, "__wrapped__", fn)
    with torch.enable_grad():
        return inner(adapter, latents)
