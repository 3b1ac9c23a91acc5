"""Stable Diffusion 3 / 3.5 adapter (diffusers ``SD3Transformer2DModel``).

The denoising loop lives in the rollout engine, not in a patched pipeline: this adapter only encodes
prompts (cached), evaluates the velocity for a batch of (latent, sigma, prompt) with optional CFG, and
decodes latents to images in [0, 1].
"""

from __future__ import annotations

from pathlib import Path

import torch

from .published import SD35_MEDIUM
from .common import DTYPES, JOINT_ATTENTION_LORA_TARGETS, PipelineAdapter, load_pipeline

SD3_PRESETS = {
    "sd3.5-medium": "stabilityai/stable-diffusion-3.5-medium",
    "sd3.5-large": "stabilityai/stable-diffusion-3.5-large",
    "sd3-medium": "stabilityai/stable-diffusion-3-medium-diffusers",
}
SD3_LORA_TARGETS = JOINT_ATTENTION_LORA_TARGETS


def load_sd3_pipeline(name_or_path: str, dtype: torch.dtype, allow_t5: bool = True):
    """Load a diffusers SD3 checkpoint by hub id or local path (downloads only if the hub is reachable)."""
    from diffusers import StableDiffusion3Pipeline

    kwargs = {} if allow_t5 else {"text_encoder_3": None, "tokenizer_3": None}
    return load_pipeline(StableDiffusion3Pipeline, SD3_PRESETS.get(name_or_path, name_or_path), dtype, "SD3", **kwargs)


class SD3Adapter(PipelineAdapter):
    """The :class:`flowrl.models.base.ModelAdapter` of SD3 / SD3.5."""

    family = "sd3"
    pipeline_class_name = "StableDiffusion3Pipeline"
    transformer_class_name = "SD3Transformer2DModel"
    published_architectures = {"stabilityai/stable-diffusion-3.5-medium": (SD35_MEDIUM, 1),
                               "random-sd3.5-medium": (SD35_MEDIUM, 1)}  # the published architecture, random weights
    lora_targets = SD3_LORA_TARGETS
    presets = SD3_PRESETS
    text_encoder_names = ("text_encoder", "text_encoder_2", "text_encoder_3")

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_config(cls, model_cfg, device="cpu") -> "SD3Adapter":
        from ..registry import MODEL_NAMES
        from .tiny import build_tiny_sd3_pipeline, load_exported_tiny_sd3

        dtype = DTYPES[model_cfg.dtype]
        name = model_cfg.pretrained
        if name in (None, "", "tiny"):
            pipe = build_tiny_sd3_pipeline(model_cfg.tiny, seed=model_cfg.tiny.init_seed)
            max_seq = 0  # no T5: zero padding tokens would only cost time
        elif name in MODEL_NAMES or (Path(name) / "pretrain.json").is_file():
            # a named embedded model, or a folder written by `flowrl pretrain-tiny --export-dir`
            pipe = cls.embedded_pipeline(model_cfg, None if name in MODEL_NAMES else load_exported_tiny_sd3)
            max_seq = getattr(pipe, "embedded_max_tokens", 0)  # T5 tokens where the pipeline has a T5
        else:
            pipe = load_sd3_pipeline(name, dtype, allow_t5=model_cfg.use_t5)
            max_seq = model_cfg.max_sequence_length if model_cfg.use_t5 else 0
        return cls(pipe, max_sequence_length=max_seq, device=device, dtype=dtype,
                   text_encoder_device=model_cfg.text_encoder_device, vae_tiling=model_cfg.vae_tiling)

    # ---------------------------------------------------------------- geometry
    @classmethod
    def memory_text_tokens(cls, model_cfg) -> int:
        return model_cfg.max_sequence_length + 77  # T5's tokens after CLIP's 77

    def latent_shape(self, resolution: int) -> tuple[int, int, int]:
        factor = self.vae_factor()
        return (self.transformer.config.in_channels, resolution // factor, resolution // factor)

    def image_seq_len(self, resolution: int) -> int:
        _, h, w = self.latent_shape(resolution)
        p = self.transformer.config.patch_size
        return (h // p) * (w // p)

    # ---------------------------------------------------------------- text and velocity
    def _encode_one(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=[prompt], prompt_2=[prompt], prompt_3=[prompt], device=self.text_device,
            do_classifier_free_guidance=False, max_sequence_length=self.max_sequence_length,
        )
        return embeds[0], pooled[0]

    def _forward(self, x, sigma, cond):
        timestep = sigma * 1000.0  # diffusers' SD3 convention: t = sigma * num_train_timesteps
        return self.transformer(
            hidden_states=x.to(self.dtype), timestep=timestep.to(self.dtype),
            encoder_hidden_states=cond.embeds.to(self.dtype), pooled_projections=cond.pooled.to(self.dtype),
            return_dict=False,
        )[0].float()
