"""HunyuanVideo 1.5 text-to-video adapter (diffusers ``HunyuanVideo15Pipeline``, ``HunyuanVideo15Transformer3DModel``).

Two text streams condition the transformer: Qwen2.5-VL's hidden states of the prompt in a chat template (the
template's prefix cropped, padded to a fixed length with a mask) and ByT5's embedding of any text in quotes (the
glyphs to render; zeros with an empty mask when the prompt quotes nothing). The first is the prompt batch's
``embeds`` / ``mask``; the second travels in ``extra`` (``glyphs``, ``glyph_mask``), both encoded once per prompt by
the pipeline's own ``encode_prompt``. Each transformer call takes the latents concatenated with zero condition
latents and a zero mask channel (text-to-video), zero vision tokens (masked), and the scheduler timestep
(sigma x 1000). The grid is the pipeline's, linspace(1, 0, T + 1) without its last point, shifted by the scheduler;
true CFG is flowrl's own (the pipeline's guider computes the same uncond + g (cond - uncond)). Latents are
(C, F', H / 16, W / 16) with F' = (frames - 1) / 4 + 1; decoding divides by the VAE's scaling factor.

The pipeline has no LoRA loader: a trained LoRA is saved in diffusers' format under the ``transformer`` prefix and
loads with ``pipe.transformer.load_lora_adapter(folder, prefix="transformer", use_safetensors=True)``.
"""

from __future__ import annotations

import torch

from .common import PipelineAdapter, PromptEmbeds
from .published import HUNYUANVIDEO15_480P

HUNYUANVIDEO15_PRESETS = {"hunyuanvideo-1.5-480p": "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v",
                          "hunyuanvideo-1.5-720p": "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_t2v"}
# the double-stream blocks' attention projections (image and text streams)
HUNYUANVIDEO15_LORA_TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                               "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"]


class HunyuanVideo15Adapter(PipelineAdapter):
    family = "hunyuanvideo15"
    pipeline_class_name = "HunyuanVideo15Pipeline"
    transformer_class_name = "HunyuanVideo15Transformer3DModel"
    published_architectures = {HUNYUANVIDEO15_PRESETS["hunyuanvideo-1.5-480p"]: (HUNYUANVIDEO15_480P, 1),
                               HUNYUANVIDEO15_PRESETS["hunyuanvideo-1.5-720p"]: (
                                   dict(HUNYUANVIDEO15_480P, target_size=720), 1)}
    video = True
    lora_targets = HUNYUANVIDEO15_LORA_TARGETS
    text_encoder_names = ("text_encoder", "text_encoder_2")
    tiny_builder = "build_tiny_hunyuanvideo15_pipeline"
    tiny_patch_pixels = 4  # the tiny VAE's 2x downsampling x 2 x 2 patches

    @classmethod
    def frames_multiple(cls, model_cfg) -> int:
        """``model.num_frames - 1`` must be a multiple of this: the VAE's temporal compression (4 for the published
        VAE, 2 for the tiny test model's)."""
        return 2 if model_cfg.pretrained in (None, "", "tiny") else 4
    real_patch_pixels = 16  # the VAE's 16x downsampling, 1 x 1 patches
    presets = HUNYUANVIDEO15_PRESETS
    family_options = ("num_frames",)
    num_frames = 17  # model.num_frames: 4k + 1 for the 4x temporal VAE

    @classmethod
    def memory_latent_shape(cls, model_cfg, config: dict) -> tuple[int, ...]:
        r = model_cfg.resolution // 16
        return (config.get("out_channels", 32), (model_cfg.num_frames - 1) // 4 + 1, r, r)

    @classmethod
    def memory_text_tokens(cls, model_cfg) -> int:
        """The pipeline pads the Qwen2.5-VL stream to 1000 tokens and ByT5's to 256, and adds 729 (masked) vision
        tokens: every call attends over all of them."""
        return 1000 + 256 + 729

    @classmethod
    def memory_text_dim(cls, config: dict) -> int:
        return config.get("text_embed_dim", 3584)

    # ---------------------------------------------------------------- geometry, schedule, decoding
    def latent_shape(self, resolution: int) -> tuple[int, int, int, int]:
        v = self.vae
        frames = (self.num_frames - 1) // v.temporal_compression_ratio + 1
        r = resolution // v.spatial_compression_ratio
        return (v.config.latent_channels, frames, r, r)

    def vae_factor(self) -> int:
        return self.vae.spatial_compression_ratio

    def image_seq_len(self, resolution: int) -> int:
        _, f, h, w = self.latent_shape(resolution)
        c = self.transformer.config
        return (f // c.patch_size_t) * (h // c.patch_size) * (w // c.patch_size)

    def patch_pixels(self, resolution: int) -> int:
        return self.vae.spatial_compression_ratio * self.transformer.config.patch_size

    def default_sigmas(self, num_steps: int, resolution: int) -> torch.Tensor:
        """HunyuanVideo15Pipeline's grid: linspace(1, 0, T + 1)[:-1] through the scheduler (its shift), then 0."""
        import numpy as np
        from diffusers import FlowMatchEulerDiscreteScheduler

        sched = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config)
        sched.set_timesteps(sigmas=np.linspace(1.0, 0.0, num_steps + 1)[:-1], device="cpu")
        return sched.sigmas.detach().float().clone()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, C, F', h, w) -> videos (B, F, 3, H, W) in [0, 1]."""
        z = (latents.float() / self.vae.config.scaling_factor).to(self.vae.dtype)
        # one sample at a time: the VAE's mid-block attention builds its causal mask as (B, L, L) against (B, 1, L, L)
        # queries, which broadcasts wrongly for B > 1 (diffusers 0.42); the pipeline decodes one video per prompt
        video = torch.cat([self.vae.decode(z[i: i + 1], return_dict=False)[0] for i in range(z.shape[0])])
        return (video.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)  # (B, 3, F, H, W) -> (B, F, 3, H, W)

    # ---------------------------------------------------------------- text and velocity
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """Both streams of each prompt, encoded once (the pipeline's ``encode_prompt``) and cached: ``embeds`` (N, L, D)
        and ``mask`` (N, L) from Qwen2.5-VL, ``extra`` ``glyphs`` (N, L2, D2) and ``glyph_mask`` (N, L2) from ByT5."""
        for p in sorted({p for p in prompts if p not in self._cache}):
            embeds, mask, glyphs, glyph_mask = self.pipe.encode_prompt(prompt=[str(p)], device=self.text_device,
                                                                       dtype=torch.float32)
            self._cache[p] = tuple(t[0].float().to(self.device) for t in (embeds, mask, glyphs, glyph_mask))
        rows = [self._cache[p] for p in prompts]
        stack = [torch.stack([r[k] for r in rows]) for k in range(4)]
        return PromptEmbeds(stack[0], stack[0].new_zeros(len(prompts), 0), stack[1],
                            extra={"glyphs": stack[2], "glyph_mask": stack[3]})

    @property
    def vision_tokens(self) -> int:
        """The masked vision tokens every text-to-video call carries (729 in the published pipeline)."""
        return getattr(getattr(self, "pipe", None), "vision_num_semantic_tokens", 729)

    def _forward(self, x, sigma, cond):
        b = x.shape[0]
        zeros = torch.zeros_like(x)  # text-to-video: no condition latents, and their mask channel all zero
        hidden = torch.cat([x, zeros, zeros[:, :1]], dim=1).to(self.dtype)  # (B, 2C + 1, F', h, w)
        vision = torch.zeros(b, self.vision_tokens, self.transformer.config.image_embed_dim, device=x.device,
                             dtype=self.dtype)
        extra = cond.extra or {}
        glyphs = extra.get("glyphs")
        if glyphs is None:  # a replica without the pipeline (benchmarks, memory): no glyph tokens
            glyphs = torch.zeros(b, 1, self.transformer.config.text_embed_2_dim, device=x.device)
            extra = {"glyph_mask": torch.zeros(b, 1, device=x.device)}
        mask = cond.mask if cond.mask is not None else torch.ones(cond.embeds.shape[:2], device=x.device)
        t = (sigma * 1000.0).to(self.dtype)  # the pipeline passes the scheduler timestep as is
        return self.transformer(
            hidden_states=hidden, timestep=t, encoder_hidden_states=cond.embeds.to(self.dtype),
            encoder_attention_mask=mask.to(self.dtype), encoder_hidden_states_2=glyphs.to(self.dtype),
            encoder_attention_mask_2=extra["glyph_mask"].to(self.dtype), image_embeds=vision, return_dict=False,
        )[0].float()

    # ---------------------------------------------------------------- LoRA
    def save_lora(self, directory, layers: dict, metadata: dict) -> None:
        """diffusers' LoRA format under the ``transformer`` prefix (the pipeline has no ``save_lora_weights``);
        ``pipe.transformer.load_lora_adapter(directory, prefix="transformer", use_safetensors=True)`` reads it."""
        from diffusers.loaders.lora_base import LoraBaseMixin

        LoraBaseMixin._save_lora_weights(save_directory=str(directory), lora_layers={"transformer": layers},
                                         lora_metadata={"transformer": metadata})
