"""Wan 2.1 / 2.2 text-to-video adapter (diffusers ``WanTransformer3DModel``).

Latents carry a frame axis, (C, F', H/8, W/8) with F' = (frames - 1) / 4 + 1; the engine, plans, kernels and
log-probs (a mean over every element) handle them as they handle images. The transformer takes the
scheduler's timestep (sigma x 1000) and the UMT5 prompt states; true CFG is the pipeline's (5.0 for Wan 2.1).
Decoding un-normalises with the VAE's per-channel statistics and returns videos (B, F, 3, H, W) in [0, 1],
the layout the video rewards read.

Wan 2.2 A14B has two experts: ``transformer`` draws the steps with timestep >= boundary_ratio x 1000 (high noise)
and ``transformer_2`` the rest, each with its own CFG scale, as ``WanPipeline`` does. One expert is trained
(``model.train_expert``) and the other stays frozen; rows of one batch at different sigmas go to their own expert.
A LoRA trained on the low-noise expert loads with ``load_lora_weights(path, load_into_transformer_2=True)``.
"""

from __future__ import annotations

import torch

from .common import PipelineAdapter
from .published import WAN21_1_3B, WAN21_14B

WAN_PRESETS = {"wan2.1-t2v-1.3b": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "wan2.1-t2v-14b": "Wan-AI/Wan2.1-T2V-14B-Diffusers",
               "wan2.2-t2v-a14b": "Wan-AI/Wan2.2-T2V-A14B-Diffusers"}
WAN_LORA_TARGETS = ["attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                    "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0"]


class WanAdapter(PipelineAdapter):
    family = "wan"
    pipeline_class_name = "WanPipeline"
    transformer_class_name = "WanTransformer3DModel"
    published_architectures = {"Wan-AI/Wan2.1-T2V-1.3B-Diffusers": (WAN21_1_3B, 1),
                               "Wan-AI/Wan2.1-T2V-14B-Diffusers": (WAN21_14B, 1),
                               "Wan-AI/Wan2.2-T2V-A14B-Diffusers": (WAN21_14B, 2)}  # two experts of 14B
    video = True

    lora_targets = WAN_LORA_TARGETS
    text_encoder_names = ("text_encoder",)

    tiny_builder = "build_tiny_wan_pipeline"
    tiny_patch_pixels = 4  # the tiny VAE's 2x downsampling x 2 x 2 patches

    @classmethod
    def frames_multiple(cls, model_cfg) -> int:
        """``model.num_frames - 1`` must be a multiple of this: the VAE's temporal compression (4 for the published
        VAE, 2 for the tiny test model's)."""
        return 2 if model_cfg.pretrained in (None, "", "tiny") else 4
    presets = WAN_PRESETS
    family_options = ("num_frames", "train_expert", "low_noise_guidance_scale")
    num_frames = 17  # model.num_frames: 4k + 1 for the 4x temporal VAE
    train_expert = "high_noise"  # Wan 2.2: which expert the policy trains
    low_noise_guidance_scale = None  # Wan 2.2: the low-noise expert's CFG scale (None: the sampler's)

    @classmethod
    def memory_latent_shape(cls, model_cfg, config: dict) -> tuple[int, ...]:
        r = model_cfg.resolution // 8
        return (config.get("in_channels", 16), (model_cfg.num_frames - 1) // 4 + 1, r, r)  # 4x temporal VAE

    def patch_pixels(self, resolution: int) -> int:
        """Pixels per latent patch along a side of a frame (the tokens of one latent frame)."""
        _, _, h, _ = self.latent_shape(resolution)
        return max(1, resolution // (h // self.transformer.config.patch_size[1]))

    def extra_transformers(self) -> list[torch.nn.Module]:
        """Wan 2.2: the frozen expert that draws the steps on the other side of the boundary."""
        second = getattr(self, "frozen_expert", None)
        return [] if second is None else [second]

    def pad_sigma(self) -> float:
        """A sigma on the trained expert's side of Wan 2.2's boundary (0.5 with one model)."""
        if self.boundary is None:
            return 0.5
        return min(1.0, self.boundary / 1000 + 0.05) if self.train_expert == "high_noise" else self.boundary / 2000

    def __init__(self, pipe, **kwargs):
        super().__init__(pipe, **kwargs)
        second = getattr(pipe, "transformer_2", None)
        ratio = pipe.config.get("boundary_ratio") if hasattr(pipe.config, "get") else None
        self.boundary = None  # timestep (sigma x 1000) from which the high-noise expert draws; None: one model
        if second is not None and ratio is not None:
            self.boundary = float(ratio) * self.scheduler_config.get("num_train_timesteps", 1000)
            second.to(self.device)
            if second.dtype != self.dtype:
                second.to(dtype=self.dtype)
            if self.train_expert == "low_noise":
                self.transformer, self.frozen_expert = second, pipe.transformer
            else:
                self.frozen_expert = second
            self.frozen_expert.to(self.device).requires_grad_(False).eval()  # held whole on every process

    def _rows_by_expert(self, sigma: torch.Tensor, run) -> torch.Tensor:
        """``run(rows, high_noise)`` for the rows each expert draws, reassembled in row order (B, *latent)."""
        high = sigma * 1000.0 >= self.boundary
        if high.all() or not high.any():
            return run(None, bool(high[0]))
        parts, order = [], []
        for flag in (True, False):
            rows = torch.nonzero(high == flag).squeeze(1)
            parts.append(run(rows, flag))
            order.append(rows)
        return torch.cat(parts)[torch.argsort(torch.cat(order))]

    # ---------------------------------------------------------------- geometry, schedule, decoding
    @property
    def temporal_factor(self) -> int:
        return 1 if self.pixel_space else 2 ** sum(self.vae.temperal_downsample)

    def vae_factor(self) -> int:
        return 1 if self.pixel_space else 2 ** len(self.vae.temperal_downsample)

    def latent_shape(self, resolution: int) -> tuple[int, int, int, int]:
        """(C, F', h, w); a pixel-space model (the embedded tiny one) draws (3, frames, H, W) directly."""
        f = self.vae_factor()
        frames = (self.num_frames - 1) // self.temporal_factor + 1
        channels = self.transformer.config.in_channels if self.pixel_space else self.vae.config.z_dim
        return (channels, frames, resolution // f, resolution // f)

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
        if self.pixel_space:
            return (latents.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)
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
        if self.boundary is None:
            return self._expert_forward(self.transformer, x, sigma, cond)

        def run(rows, high_noise):
            trained_is_high = self.train_expert == "high_noise"
            model = self.transformer if high_noise == trained_is_high else self.frozen_expert
            if rows is None:
                return self._expert_forward(model, x, sigma, cond)
            return self._expert_forward(model, x[rows], sigma[rows], cond.index(rows))

        return self._rows_by_expert(sigma, run)

    def _expert_forward(self, model, x, sigma, cond):
        t = (sigma * 1000.0).to(self.dtype)  # WanPipeline passes the scheduler timestep as is
        return model(hidden_states=x.to(self.dtype), timestep=t, encoder_hidden_states=cond.embeds.to(self.dtype),
                     return_dict=False)[0].float()

    def velocity(self, x, sigma, cond, guidance_scale=1.0, negative=None, unconditional_grad=True):
        """As every family's, except that Wan 2.2's low-noise steps use their own CFG scale."""
        low_scale = self.low_noise_guidance_scale
        if self.boundary is None or low_scale is None or negative is None:
            return super().velocity(x, sigma, cond, guidance_scale, negative, unconditional_grad)
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).expand(x.shape[0])

        def run(rows, high_noise):
            scale = guidance_scale if high_noise else low_scale
            if rows is None:
                return super(WanAdapter, self).velocity(x, sigma, cond, scale, negative, unconditional_grad)
            return super(WanAdapter, self).velocity(x[rows], sigma[rows], cond.index(rows), scale, negative,
                                                    unconditional_grad)

        return self._rows_by_expert(sigma, run)
