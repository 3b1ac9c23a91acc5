"""FLUX.1 (dev, schnell) adapter (diffusers ``FluxTransformer2DModel``).

The engine keeps FLUX latents unpacked, (C, H/8, W/8) like every image family, so plans, kernels and
log-probs (a mean over the same elements) see nothing family-specific; :meth:`FluxAdapter._forward` packs
2x2 patches into tokens, adds their position ids and unpacks the velocity. FLUX.1-dev's guidance is
distilled into an embedding (``model.guidance``, 3.5), so true CFG (``sampler.guidance_scale`` > 1 with a
negative prompt) is off by default, as in diffusers' ``FluxPipeline``; the schedule is the pipeline's
linspace(1, 1/T, T) with the resolution-dependent shift mu.
"""

from __future__ import annotations

import torch

from .published import FLUX1_DEV
from .common import JOINT_ATTENTION_LORA_TARGETS, PipelineAdapter

FLUX_PRESETS = {
    "flux.1-dev": "black-forest-labs/FLUX.1-dev",
    "flux.1-schnell": "black-forest-labs/FLUX.1-schnell",
}
# the joint blocks' attention projections; the single-stream blocks name theirs to_q / to_k / to_v as well, so
# the same suffixes reach them (DanceGRPO's FLUX LoRA targets are to_k / to_q / to_v / to_out.0)
FLUX_LORA_TARGETS = JOINT_ATTENTION_LORA_TARGETS


def pack(x: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, 4C): 2x2 patches as tokens, FluxPipeline's order."""
    b, c, h, w = x.shape
    return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The inverse of :func:`pack`: (B, H/2 * W/2, 4C) -> (B, C, H, W)."""
    b, _, d = tokens.shape
    return tokens.view(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, d // 4, h, w)


def image_ids(h: int, w: int) -> torch.Tensor:
    """(H/2 * W/2, 3) position ids of the packed tokens: (0, row, column)."""
    ids = torch.zeros(h // 2, w // 2, 3)
    ids[..., 1] = torch.arange(h // 2)[:, None]
    ids[..., 2] = torch.arange(w // 2)[None, :]
    return ids.reshape(-1, 3)


class FluxAdapter(PipelineAdapter):
    family = "flux"
    pipeline_class_name = "FluxPipeline"
    transformer_class_name = "FluxTransformer2DModel"
    published_architectures = {"black-forest-labs/FLUX.1-dev": (FLUX1_DEV, 1),
                               "black-forest-labs/FLUX.1-schnell": (dict(FLUX1_DEV, guidance_embeds=False), 1)}
    context_parallel_splits_text = True

    lora_targets = FLUX_LORA_TARGETS
    text_encoder_names = ("text_encoder", "text_encoder_2")

    tiny_builder = "build_tiny_flux_pipeline"
    tiny_patch_pixels = 4  # the tiny VAE's 2x downsampling x 2 x 2 patches
    presets = FLUX_PRESETS
    family_options = ("guidance",)
    guidance = 3.5  # FLUX.1-dev's distilled guidance (model.guidance)

    @classmethod
    def memory_latent_shape(cls, model_cfg, config: dict) -> tuple[int, ...]:
        r = model_cfg.resolution // 8  # the engine's latents stay unpacked: the adapter packs 2x2 patches
        return (config.get("in_channels", 64) // 4, r, r)

    # ---------------------------------------------------------------- geometry and schedule
    def latent_shape(self, resolution: int) -> tuple[int, int, int]:
        f = self.vae_factor()
        return (self.transformer.config.in_channels // 4, resolution // f, resolution // f)

    def default_sigmas(self, num_steps: int, resolution: int) -> torch.Tensor:
        return self.linspace_shifted_sigmas(num_steps, resolution)

    # ---------------------------------------------------------------- text and velocity
    def _encode_one(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, pooled, _ = self.pipe.encode_prompt(prompt=[prompt], prompt_2=[prompt], device=self.text_device,
                                                    max_sequence_length=self.max_sequence_length)
        return embeds[0], pooled[0]

    def reference_tokens(self, cond) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Tokens the transformer attends to after the image's own: (B, T, 4C) tokens and their (T, 3) position
        ids, or None (text-to-image FLUX.1 has none; FLUX.1 Kontext's are its source image's)."""
        return None

    def _forward(self, x, sigma, cond):
        b, _, h, w = x.shape
        embeds, pooled = cond.embeds, cond.pooled
        guidance = None
        if self.transformer.config.guidance_embeds:  # FLUX.1-dev's distilled guidance, one value per sample
            guidance = torch.full((b,), self.guidance, device=x.device, dtype=torch.float32)
        t = (sigma * 1000.0).to(self.dtype)  # the pipeline's scheduler timestep, which it divides by 1000
        tokens, ids = pack(x), image_ids(h, w).to(x.device)  # (B, hw/4, 4C), (hw/4, 3)
        extra = self.reference_tokens(cond)
        if extra is not None:  # the sequence is [image; reference]; the velocity is read off the image's tokens
            tokens, ids = torch.cat([tokens, extra[0]], dim=1), torch.cat([ids, extra[1].to(x.device)])
        out = self.transformer(
            hidden_states=tokens.to(self.dtype), timestep=t / 1000, guidance=guidance,
            pooled_projections=pooled.to(self.dtype), encoder_hidden_states=embeds.to(self.dtype),
            txt_ids=torch.zeros(embeds.shape[1], 3, device=x.device, dtype=self.dtype),
            img_ids=ids.to(dtype=self.dtype), return_dict=False,
        )[0]
        return unpack(out[:, : (h // 2) * (w // 2)].float(), h, w)
