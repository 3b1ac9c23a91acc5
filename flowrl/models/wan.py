"""Wan 2.1 text-to-video adapter (diffusers ``WanTransformer3DModel``).

Latents carry a frame axis, (C, F', H/8, W/8) with F' = (frames - 1) / 4 + 1; the engine, plans, kernels and
log-probs (a mean over every element) handle them as they handle images. The transformer takes the
scheduler's timestep (sigma x 1000) and the UMT5 prompt states; true CFG is the pipeline's (5.0 for Wan 2.1).
Decoding un-normalises with the VAE's per-channel statistics and returns videos (B, F, 3, H, W) in [0, 1],
the layout the video rewards read.
"""

from __future__ import annotations

import torch

from .common import PipelineAdapter

WAN_PRESETS = {"wan2.1-t2v-1.3b": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "wan2.1-t2v-14b": "Wan-AI/Wan2.1-T2V-14B-Diffusers"}
WAN_LORA_TARGETS = ["attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                    "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0"]


class WanAdapter(PipelineAdapter):
    family = "wan"
    pipeline_class_name = "WanPipeline"
    lora_targets = WAN_LORA_TARGETS
    text_encoder_names = ("text_encoder",)

    tiny_builder = "build_tiny_wan_pipeline"
    presets = WAN_PRESETS
    family_options = ("num_frames",)
    num_frames = 17  # model.num_frames: 4k + 1 for the 4x temporal VAE

    # ---------------------------------------------------------------- geometry, schedule, decoding
    @property
    def temporal_factor(self) -> int:
        return 2 ** sum(self.vae.temperal_downsample)

    def vae_factor(self) -> int:
        return 2 ** len(self.vae.temperal_downsample)

    def latent_shape(self, resolution: int) -> tuple[int, int, int, int]:
        f = self.vae_factor()
        frames = (self.num_frames - 1) // self.temporal_factor + 1
        return (self.vae.config.z_dim, frames, resolution // f, resolution // f)

    def image_seq_len(self, resolution: int) -> int:
        c, f, h, w = self.latent_shape(resolution)
        p = self.transformer.config.patch_size
        return (f // p[0]) * (h // p[1]) * (w // p[2])

    def default_sigmas(self, num_steps: int, resolution: int) -> torch.Tensor:
        """The flow-matching grid with Wan's flow shift (FlowMatchEuler's, or UniPC's ``flow_shift``)."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        from ..samplers.schedules import diffusers_sigmas

        c = self.scheduler_config
        if self.pipe.scheduler.__class__.__name__ == "FlowMatchEulerDiscreteScheduler":
            return diffusers_sigmas(c, num_steps)
        euler = FlowMatchEulerDiscreteScheduler(shift=c.get("flow_shift", 1.0) or 1.0,
                                                num_train_timesteps=c.get("num_train_timesteps", 1000))
        return diffusers_sigmas(dict(euler.config), num_steps)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, C, F', h, w) -> videos (B, F, 3, H, W) in [0, 1]."""
        c = self.vae.config
        mean = torch.tensor(c.latents_mean, device=latents.device).view(1, c.z_dim, 1, 1, 1)
        std = torch.tensor(c.latents_std, device=latents.device).view(1, c.z_dim, 1, 1, 1)
        video = self.vae.decode((latents.float() * std + mean).to(self.vae.dtype), return_dict=False)[0]
        return (video.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)  # (B, 3, F, H, W) -> (B, F, 3, H, W)

    # ---------------------------------------------------------------- text and velocity
    def _encode_one(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, _ = self.pipe.encode_prompt(prompt=[prompt], do_classifier_free_guidance=False,
                                            max_sequence_length=self.max_sequence_length, device=self.text_device)
        return embeds[0], embeds.new_zeros(0)

    def _forward(self, x, sigma, cond):
        t = (sigma * 1000.0).to(self.dtype)  # WanPipeline passes the scheduler timestep as is
        return self.transformer(hidden_states=x.to(self.dtype), timestep=t,
                                encoder_hidden_states=cond.embeds.to(self.dtype), return_dict=False)[0].float()
