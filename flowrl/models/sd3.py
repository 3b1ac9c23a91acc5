"""Stable Diffusion 3 / 3.5 adapter (diffusers ``SD3Transformer2DModel``).

The denoising loop lives in the rollout engine, not in a patched pipeline: this adapter only encodes
prompts (cached), evaluates the velocity for a batch of (latent, sigma, prompt) with optional CFG, and
decodes latents to images in [0, 1].
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ConfigError

SD3_PRESETS = {
    "sd3.5-medium": "stabilityai/stable-diffusion-3.5-medium",
    "sd3.5-large": "stabilityai/stable-diffusion-3.5-large",
    "sd3-medium": "stabilityai/stable-diffusion-3-medium-diffusers",
}
# Flow-GRPO's SD3 LoRA targets (spec/anchors.md 2.2).
SD3_LORA_TARGETS = [
    "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
    "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v",
]


@dataclass
class PromptEmbeds:
    embeds: torch.Tensor  # (N, L, D) joint text tokens
    pooled: torch.Tensor  # (N, P) pooled projections

    def index(self, idx: torch.Tensor) -> "PromptEmbeds":
        return PromptEmbeds(self.embeds[idx], self.pooled[idx])


def load_sd3_pipeline(name_or_path: str, dtype: torch.dtype, allow_t5: bool = True):
    """Load a diffusers SD3 checkpoint by hub id or local path (downloads only if the hub is reachable)."""
    from diffusers import StableDiffusion3Pipeline

    source = SD3_PRESETS.get(name_or_path, name_or_path)
    kwargs = {} if allow_t5 else {"text_encoder_3": None, "tokenizer_3": None}
    try:
        return StableDiffusion3Pipeline.from_pretrained(source, torch_dtype=dtype, **kwargs)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"model.pretrained: cannot load SD3 pipeline {source!r} ({first}); give a local diffusers "
                          "folder or a hub id reachable from this machine") from exc


class SD3Adapter:
    """The :class:`flowrl.models.base.ModelAdapter` of SD3 / SD3.5."""

    family = "sd3"

    def __init__(self, pipe, max_sequence_length: int = 256, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32):
        self.pipe = pipe
        self.transformer = pipe.transformer
        self.vae = pipe.vae
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_sequence_length = max_sequence_length
        self._cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.pipe.to(self.device)
        for module in (pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3, pipe.vae):
            if module is not None:
                module.requires_grad_(False).eval()
        if self.transformer.dtype != dtype:
            self.transformer.to(dtype=dtype)

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_config(cls, model_cfg, device="cpu") -> "SD3Adapter":
        from ..registry import MODEL_NAMES, resolve
        from .tiny import build_tiny_sd3_pipeline

        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[model_cfg.dtype]
        name = model_cfg.pretrained
        if name in (None, "", "tiny"):
            pipe = build_tiny_sd3_pipeline(model_cfg.tiny, seed=model_cfg.tiny.init_seed)
            max_seq = 0  # no T5: zero padding tokens would only cost time (tiny-default.md)
        elif name in MODEL_NAMES or (Path(name) / "pretrain.json").is_file():
            # a named embedded model, or a folder written by `flowrl pretrain-tiny --export-dir`
            loader = resolve(MODEL_NAMES, name if name in MODEL_NAMES else "tiny-shapes", "model.pretrained")
            pipe = loader(None if name in MODEL_NAMES else name)
            size = pipe.transformer.config.sample_size
            if model_cfg.resolution != size:
                raise ConfigError(f"model.resolution: the {name} model draws {size} px images; set "
                                  f"model.resolution={size}")
            max_seq = 0
        else:
            pipe = load_sd3_pipeline(name, dtype, allow_t5=model_cfg.use_t5)
            max_seq = model_cfg.max_sequence_length if model_cfg.use_t5 else 0
        return cls(pipe, max_sequence_length=max_seq, device=device, dtype=dtype)

    @property
    def scheduler_config(self) -> dict:
        return dict(self.pipe.scheduler.config)

    # ---------------------------------------------------------------- geometry
    @property
    def pixel_space(self) -> bool:
        return self.vae is None

    def latent_shape(self, resolution: int) -> tuple[int, int, int]:
        cfg = self.transformer.config
        factor = 1 if self.pixel_space else 2 ** (len(self.vae.config.block_out_channels) - 1)
        return (cfg.in_channels, resolution // factor, resolution // factor)

    def image_seq_len(self, resolution: int) -> int:
        _, h, w = self.latent_shape(resolution)
        p = self.transformer.config.patch_size
        return (h // p) * (w // p)

    # ---------------------------------------------------------------- text
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """Embeddings for each prompt, computed once per distinct string and cached."""
        # One prompt per call: batched matmuls can round differently with batch composition, and a prompt's
        # embedding must not depend on which other prompts happened to be encoded with it (exact resume).
        for p in sorted({p for p in prompts if p not in self._cache}):
            embeds, _, pooled, _ = self.pipe.encode_prompt(
                prompt=[p], prompt_2=[p], prompt_3=[p], device=self.device,
                do_classifier_free_guidance=False, max_sequence_length=self.max_sequence_length,
            )
            self._cache[p] = (embeds[0].float(), pooled[0].float())
        return PromptEmbeds(torch.stack([self._cache[p][0] for p in prompts]),
                            torch.stack([self._cache[p][1] for p in prompts]))

    # ---------------------------------------------------------------- velocity
    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: PromptEmbeds, guidance_scale: float = 1.0,
                 negative: PromptEmbeds | None = None) -> torch.Tensor:
        """v(x, sigma | prompt) for a batch; x (B, C, H, W) fp32, sigma (B,), cond rows aligned with x.

        With ``guidance_scale > 1`` and a negative embedding the batch is doubled ``[neg; pos]`` and
        ``v = v_neg + g (v_pos - v_neg)``. Returns fp32 (B, C, H, W).
        """
        b = x.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).expand(b)
        timestep = sigma * 1000.0  # diffusers' SD3 convention: t = sigma * num_train_timesteps
        embeds, pooled = cond.embeds, cond.pooled
        use_cfg = guidance_scale > 1.0 and negative is not None
        if use_cfg:
            x_in = torch.cat([x, x])
            timestep = torch.cat([timestep, timestep])
            embeds = torch.cat([negative.embeds.expand_as(embeds), embeds])
            pooled = torch.cat([negative.pooled.expand_as(pooled), pooled])
        else:
            x_in = x
        out = self.transformer(
            hidden_states=x_in.to(self.dtype), timestep=timestep.to(self.dtype),
            encoder_hidden_states=embeds.to(self.dtype), pooled_projections=pooled.to(self.dtype), return_dict=False,
        )[0].float()
        if use_cfg:
            v_neg, v_pos = out.chunk(2)
            out = v_neg + guidance_scale * (v_pos - v_neg)
        return out

    # ---------------------------------------------------------------- images
    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents (B, C, h, w) -> images (B, 3, H, W) in [0, 1], fp32."""
        if self.pixel_space:
            return (latents.float() / 2 + 0.5).clamp(0, 1)
        cfg = self.vae.config
        z = latents / cfg.scaling_factor + (cfg.shift_factor or 0.0)
        image = self.vae.decode(z.to(self.vae.dtype), return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)

    # ---------------------------------------------------------------- LoRA and weights
    lora_targets = SD3_LORA_TARGETS

    def save_lora(self, directory, layers: dict, metadata: dict) -> None:
        """LoRA weights in diffusers' SD3 format (``StableDiffusion3Pipeline.load_lora_weights`` reads them)."""
        from diffusers import StableDiffusion3Pipeline

        StableDiffusion3Pipeline.save_lora_weights(str(directory), transformer_lora_layers=layers,
                                                   transformer_lora_adapter_metadata=metadata)

    @contextmanager
    def reference(self):
        """The reference policy: the same transformer with its LoRA adapters disabled."""
        if getattr(self.transformer, "_hf_peft_config_loaded", False):
            self.transformer.disable_adapters()
            try:
                yield
            finally:
                self.transformer.enable_adapters()
        else:
            raise RuntimeError("a reference policy needs LoRA (full fine-tuning keeps no frozen copy); set train.kl_beta=0")
