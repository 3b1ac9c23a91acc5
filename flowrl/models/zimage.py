"""Z-Image adapter (diffusers ``ZImageTransformer2DModel`` through ``ZImagePipeline``): Z-Image-Turbo and the
Z-Image base model, a single-stream DiT with a Qwen3 text encoder and FLUX's 16-channel VAE.

The pipeline keeps only each prompt's real tokens (the chat-templated prompt's hidden states of the encoder's
second-to-last layer), so prompts encode to different lengths: the adapter pads them with a mask and hands the
transformer each row's own tokens. The transformer takes one (C, 1, H, W) latent per sample and the time 1 - sigma,
and predicts minus the velocity. Its CFG is ``v_pos + g (v_pos - v_neg)`` with the pipeline's ``guidance_scale`` g
(0 = off): ``sampler.guidance_scale`` is ``1 + g`` here (6.0 for the pipeline's default 5.0; 1 for Turbo, which
is distilled to sample without CFG). The grid is linspace(1, 1/T, T) through the scheduler's shift.
"""

from __future__ import annotations

import torch

from .common import PipelineAdapter
from .published import ZIMAGE_6B

ZIMAGE_PRESETS = {"z-image-turbo": "Tongyi-MAI/Z-Image-Turbo", "z-image": "Tongyi-MAI/Z-Image"}
# the attention projections of every block (the noise and context refiners' and the main layers')
ZIMAGE_LORA_TARGETS = ["attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0"]


class ZImageAdapter(PipelineAdapter):
    family = "zimage"
    pipeline_class_name = "ZImagePipeline"
    transformer_class_name = "ZImageTransformer2DModel"
    published_architectures = {"Tongyi-MAI/Z-Image-Turbo": (ZIMAGE_6B, 1), "Tongyi-MAI/Z-Image": (ZIMAGE_6B, 1)}
    lora_targets = ZIMAGE_LORA_TARGETS
    text_encoder_names = ("text_encoder",)
    variable_length = True  # the pipeline keeps each prompt's real tokens only
    tiny_builder = "build_tiny_zimage_pipeline"
    tiny_patch_pixels = 4  # the tiny VAE's 2x downsampling x 2 x 2 patches
    presets = ZIMAGE_PRESETS

    @classmethod
    def memory_heads(cls, config: dict) -> tuple[int, int]:
        return config["n_heads"], config["dim"] // config["n_heads"]

    @classmethod
    def memory_block_counts(cls, config: dict) -> dict[str, int]:
        return {"n_layers": config["n_layers"]}

    @classmethod
    def memory_narrow(cls, config: dict, heads: int, blocks: dict[str, int]) -> dict:
        head_dim = config["dim"] // config["n_heads"]
        return {"n_heads": heads, "n_kv_heads": heads, "dim": heads * head_dim, **blocks}

    @classmethod
    def memory_text_dim(cls, config: dict) -> int:
        return config["cap_feat_dim"]

    @classmethod
    def memory_text_tokens(cls, model_cfg) -> int:
        return min(model_cfg.max_sequence_length, 128)  # a typical prompt's real tokens (padding is dropped)

    # ---------------------------------------------------------------- geometry, schedule, decoding
    def latent_shape(self, resolution: int) -> tuple[int, int, int]:
        f = self.vae_factor()
        return (self.transformer.config.in_channels, resolution // f, resolution // f)

    def default_sigmas(self, num_steps: int, resolution: int) -> torch.Tensor:
        return self.linspace_shifted_sigmas(num_steps, resolution)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        c = self.vae.config
        z = latents.to(self.vae.dtype) / c.scaling_factor + c.shift_factor
        image = self.vae.decode(z, return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)

    # ---------------------------------------------------------------- text and velocity
    def _encode_one(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        (embeds,) = self.pipe._encode_prompt([prompt], device=self.text_device,
                                             max_sequence_length=self.max_sequence_length)
        return embeds, embeds.new_zeros(0)  # (L, D) the prompt's real tokens; no pooled projection

    def _forward(self, x, sigma, cond):
        """x (B, C, H, W), sigma (B,): the transformer takes per-sample lists and 1 - sigma, and returns -v."""
        rows = [cond.embeds[i] if cond.mask is None else cond.embeds[i][cond.mask[i].bool()] for i in range(len(x))]
        latents = list(x.to(self.dtype).unsqueeze(2).unbind(0))  # B x (C, 1, H, W)
        out = self.transformer(latents, (1.0 - sigma).to(self.dtype), [r.to(self.dtype) for r in rows],
                               return_dict=False)[0]
        return -torch.stack([o.float() for o in out]).squeeze(2)  # (B, C, H, W)
