"""What every diffusers-pipeline adapter shares: frozen encoders, the per-prompt embedding cache, true CFG by
batch doubling, VAE decoding, the LoRA-off reference policy, LoRA saving in the family's format and the
family pipeline's own sigma schedule. A family adds its text encoding (:meth:`_encode_one`), its transformer
call (:meth:`_forward`) and its latent geometry."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..errors import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class PromptEmbeds:
    embeds: torch.Tensor  # (N, L, D) text tokens (padded to the longest prompt where lengths differ)
    pooled: torch.Tensor  # (N, P) pooled projections (P = 0 for families without one)
    mask: torch.Tensor | None = None  # (N, L) 1 for real tokens; None when every prompt has L tokens

    def index(self, idx: torch.Tensor) -> "PromptEmbeds":
        return PromptEmbeds(self.embeds[idx], self.pooled[idx], None if self.mask is None else self.mask[idx])


def load_pipeline(pipeline_class, source: str, dtype: torch.dtype, family: str, **kwargs):
    """A diffusers pipeline by hub id or local folder (downloads only where the hub is reachable)."""
    try:
        return pipeline_class.from_pretrained(source, torch_dtype=dtype, **kwargs)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"model.pretrained: cannot load {family} pipeline {source!r} ({first}); give a local "
                          "diffusers folder or a hub id reachable from this machine") from exc


class PipelineAdapter:
    family = "base"
    pipeline_class_name = ""  # the diffusers pipeline whose LoRA format and schedule this family uses
    lora_targets: list[str] = []
    text_encoder_names: tuple[str, ...] = ()
    variable_length = False  # prompts encode to different token counts (padded, with a mask)

    def __init__(self, pipe, max_sequence_length: int = 256, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, text_encoder_device: str = "same", vae_tiling: bool = False):
        self.pipe = pipe
        self.transformer = pipe.transformer
        self.vae = pipe.vae
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_sequence_length = max_sequence_length
        self._cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        # each prompt is encoded once and cached, so the text encoders (T5-XXL: 9.5 GB in bf16) can live on the
        # CPU and leave the accelerator to the transformer
        self.text_device = self.device if text_encoder_device == "same" else torch.device(text_encoder_device)
        self.pipe.to(self.device)
        for name in (*self.text_encoder_names, "vae"):
            module = getattr(pipe, name, None)
            if module is not None:
                module.requires_grad_(False).eval()
                if name != "vae":
                    module.to(self.text_device)
        if vae_tiling and self.vae is not None:  # decode large images in tiles and one sample at a time
            self.vae.enable_slicing()
            self.vae.enable_tiling()
        if self.transformer.dtype != dtype:
            self.transformer.to(dtype=dtype)

    # ---------------------------------------------------------------- construction
    presets: dict[str, str] = {}  # short names -> hub ids
    tiny_builder = ""  # the function in flowrl.models.tiny that builds this family's tiny offline pipeline
    tiny_sequence_length = True  # the tiny model encodes model.tiny.max_tokens tokens (else model.max_sequence_length)

    @classmethod
    def build_tiny(cls, tiny) -> tuple[object, dict]:
        """(a tiny pipeline of this family from ``model.tiny``, extra constructor options)."""
        from . import tiny as tiny_models

        out = getattr(tiny_models, cls.tiny_builder)(tiny, seed=tiny.init_seed)
        return out if isinstance(out, tuple) else (out, {})

    @classmethod
    def options(cls, model_cfg) -> dict:
        """Family-specific constructor options from ``model`` (guidance, frames, ...)."""
        return {}

    @classmethod
    def from_config(cls, model_cfg, device="cpu"):
        """The tiny offline model (``pretrained: tiny``), or a checkpoint by short name, hub id or local folder."""
        import diffusers

        dtype = DTYPES[model_cfg.dtype]
        extra = cls.options(model_cfg)
        if model_cfg.pretrained in (None, "", "tiny"):
            pipe, tiny_extra = cls.build_tiny(model_cfg.tiny)
            extra.update(tiny_extra)
            max_seq = model_cfg.tiny.max_tokens if cls.tiny_sequence_length else model_cfg.max_sequence_length
        else:
            source = cls.presets.get(model_cfg.pretrained, model_cfg.pretrained)
            pipe = load_pipeline(getattr(diffusers, cls.pipeline_class_name), source, dtype, cls.family)
            max_seq = model_cfg.max_sequence_length
        return cls(pipe, max_sequence_length=max_seq, device=device, dtype=dtype,
                   text_encoder_device=model_cfg.text_encoder_device, vae_tiling=model_cfg.vae_tiling, **extra)

    # ---------------------------------------------------------------- text
    def _encode_one(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(embeds (L, D), pooled (P,)) of one prompt."""
        raise NotImplementedError

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """Embeddings for each prompt, computed once per distinct string and cached."""
        # One prompt per call: batched matmuls can round differently with batch composition, and a prompt's
        # embedding must not depend on which other prompts happened to be encoded with it (exact resume).
        for p in sorted({p for p in prompts if p not in self._cache}):
            embeds, pooled = self._encode_one(p)
            self._cache[p] = (embeds.float().to(self.device), pooled.float().to(self.device))
        pooled = torch.stack([self._cache[p][1] for p in prompts])
        lengths = [self._cache[p][0].shape[0] for p in prompts]
        if not self.variable_length:
            return PromptEmbeds(torch.stack([self._cache[p][0] for p in prompts]), pooled)
        width = max(lengths)  # (N, L_max, D) zero-padded, with its mask
        embeds = torch.stack([torch.nn.functional.pad(self._cache[p][0], (0, 0, 0, width - n))
                              for p, n in zip(prompts, lengths)])
        mask = torch.stack([(torch.arange(width, device=self.device) < n).long() for n in lengths])
        return PromptEmbeds(embeds, pooled, mask)

    # ---------------------------------------------------------------- velocity
    def _forward(self, x: torch.Tensor, sigma: torch.Tensor, embeds: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """The transformer's velocity for x (B, *latent) at sigma (B,), fp32 out."""
        raise NotImplementedError

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: PromptEmbeds, guidance_scale: float = 1.0,
                 negative: PromptEmbeds | None = None) -> torch.Tensor:
        """v(x, sigma | prompt) for a batch; x (B, *latent) fp32, sigma (B,), cond rows aligned with x.

        With ``guidance_scale > 1`` and a negative embedding the batch is doubled ``[neg; pos]`` and
        ``v = v_neg + g (v_pos - v_neg)`` (true CFG). Returns fp32 (B, *latent).
        """
        b = x.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).expand(b)
        embeds, pooled = cond.embeds, cond.pooled
        use_cfg = guidance_scale > 1.0 and negative is not None
        if use_cfg:
            x = torch.cat([x, x])
            sigma = torch.cat([sigma, sigma])
            embeds = torch.cat([negative.embeds.expand_as(embeds), embeds])
            pooled = torch.cat([negative.pooled.expand_as(pooled), pooled])
        out = self._forward(x, sigma, embeds, pooled)
        if use_cfg:
            v_neg, v_pos = out.chunk(2)
            out = v_neg + guidance_scale * (v_pos - v_neg)
        return out

    # ---------------------------------------------------------------- geometry and schedule
    @property
    def pixel_space(self) -> bool:
        return self.vae is None

    def vae_factor(self) -> int:
        return 1 if self.pixel_space else 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def scheduler_config(self) -> dict:
        return dict(self.pipe.scheduler.config)

    def default_sigmas(self, num_steps: int, resolution: int) -> torch.Tensor:
        """The sigmas the family's diffusers pipeline uses (its scheduler's own grid, dynamic shift included)."""
        from ..samplers.schedules import diffusers_sigmas, dynamic_shift_mu

        c = self.scheduler_config
        mu = None
        if c.get("use_dynamic_shifting", False):
            mu = dynamic_shift_mu(self.image_seq_len(resolution), c.get("base_image_seq_len", 256),
                                  c.get("max_image_seq_len", 4096), c.get("base_shift", 0.5), c.get("max_shift", 1.15))
        return diffusers_sigmas(c, num_steps, mu)

    def linspace_shifted_sigmas(self, num_steps: int, resolution: int) -> torch.Tensor:
        """FluxPipeline's and QwenImagePipeline's grid: sigmas linspace(1, 1/T, T), shifted with mu from the
        packed token count, then a final 0."""
        import numpy as np
        from diffusers import FlowMatchEulerDiscreteScheduler

        from ..samplers.schedules import dynamic_shift_mu

        c = self.scheduler_config
        mu = dynamic_shift_mu(self.image_seq_len(resolution), c.get("base_image_seq_len", 256),
                              c.get("max_image_seq_len", 4096), c.get("base_shift", 0.5), c.get("max_shift", 1.15))
        sched = FlowMatchEulerDiscreteScheduler.from_config(c)
        sched.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), device="cpu", mu=mu)
        return sched.sigmas.detach().float().clone()

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

    # ---------------------------------------------------------------- LoRA
    def save_lora(self, directory, layers: dict, metadata: dict) -> None:
        """LoRA weights in the family's diffusers format (its pipeline's ``load_lora_weights`` reads them)."""
        import diffusers

        getattr(diffusers, self.pipeline_class_name).save_lora_weights(
            str(directory), transformer_lora_layers=layers, transformer_lora_adapter_metadata=metadata)

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
