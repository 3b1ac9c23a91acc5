"""LTX-2 text-to-video adapter (diffusers ``LTX2Pipeline``, ``LTX2VideoTransformer3DModel``).

LTX-2 generates a video and its soundtrack together: one transformer carries a video stream and an audio stream that
attend to each other in every block. The rollout therefore denoises both. A sample's latent is the two packed token
sequences one after the other, (S_video + S_audio, C): the video's F' x h x w tokens (C channels each) and then the
audio's latent frames (the audio VAE's channels x mel bins, which LTX-2 makes the same width C). The samplers, the
SDE noise and the log-probabilities treat the pair as one state, as the pipeline's two schedulers step them
together; rewards score the decoded video, and the LoRA adapters sit in the video stream's attention
(``lora_targets``), so training changes what the video stream draws. The audio is never decoded by flowrl.

Text: Gemma 3's hidden states of every layer, stacked and left-padded to ``model.max_sequence_length`` (the
pipeline's 1024), pass through the pipeline's text connectors, which give each stream its own text tokens and one
mask: ``embeds`` / ``mask`` are the video stream's, ``extra["audio_embeds"]`` the audio stream's, encoded once per
prompt. Each transformer call takes the scheduler timestep (sigma x 1000) as ``timestep`` and ``sigma``, the
frame rate for the video positions, and the pipeline's cross-modal timestep (``use_cross_timestep``).

Guidance: flowrl's true CFG, uncond + g (cond - uncond) on both streams at one scale. The pipeline combines the
same two calls in x0 space ((g - 1) (x0_cond - x0_uncond) added to x0_cond), which is the same velocity; its further
terms (spatio-temporal guidance, modality-isolation guidance, guidance rescale, a separate audio scale of 7) are
not applied. The grid is the pipeline's, linspace(1, 1/T, T) shifted by the video token count (base 1024 -> 0.95,
4096 -> 2.05), then 0.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from .common import PipelineAdapter, PromptEmbeds
from .published import LTX2_19B

LTX2_PRESETS = {"ltx-2": "Lightricks/LTX-2"}
# the video stream's self-attention and text cross-attention (``audio_attn1`` / ``audio_attn2`` are not matched:
# peft matches a target at a dot boundary)
LTX2_LORA_TARGETS = ["attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                     "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0"]


class LTX2Adapter(PipelineAdapter):
    family = "ltx2"
    pipeline_class_name = "LTX2Pipeline"
    transformer_class_name = "LTX2VideoTransformer3DModel"
    published_architectures = {LTX2_PRESETS["ltx-2"]: (LTX2_19B, 1)}
    video = True
    lora_targets = LTX2_LORA_TARGETS
    text_encoder_names = ("text_encoder", "connectors")
    tiny_builder = "build_tiny_ltx2_pipeline"
    tiny_patch_pixels = 4  # the tiny VAE's 4x spatial compression, 1 x 1 patches
    real_patch_pixels = 32  # the VAE's 32x spatial compression, 1 x 1 patches
    tiny_frames_multiple = 4  # the tiny VAE's 4x temporal compression
    real_frames_multiple = 8  # the VAE's 8x temporal compression: num_frames = 8k + 1
    presets = LTX2_PRESETS
    family_options = ("num_frames",)
    num_frames = 121  # model.num_frames; the pipeline's default
    frame_rate = 24.0  # the pipeline's default frame rate: the video positions and the audio's length follow it
    use_cross_timestep = True  # the pipeline's default cross-modal timestep for the audio-video attention

    @classmethod
    def frames_multiple(cls, model_cfg) -> int:
        """``model.num_frames - 1`` must be a multiple of this: the VAE's temporal compression (a local folder's
        ``vae/config.json`` says its own)."""
        import json
        from pathlib import Path

        if model_cfg.pretrained in (None, "", "tiny"):
            return cls.tiny_frames_multiple
        vae_config = Path(str(model_cfg.pretrained)) / "vae" / "config.json"
        if vae_config.is_file():  # unset: the VAE's own rule, its temporal patch x 2 per scaling stage
            c = json.loads(vae_config.read_text())
            return int(c.get("temporal_compression_ratio") or
                       c.get("patch_size_t", 1) * 2 ** sum(c.get("spatio_temporal_scaling", (True,) * 3)))
        return cls.real_frames_multiple

    context_parallel_refusal = "diffusers' plan splits the video tokens only; the audio stream attends to all of them"

    @classmethod
    def context_parallel_plan(cls) -> dict | None:
        """None: diffusers' plan splits the video tokens only, so the audio stream's attention to the video would see
        one shard of it; LTX-2 trains on one process per sample (FSDP2 shards its weights)."""
        return None

    # ---------------------------------------------------------------- geometry (from the transformer's config)
    @staticmethod
    def _audio_frames(num_frames: int, frame_rate: float, config) -> int:
        """Latent audio frames of a clip: its seconds x sample rate / hop length / the audio VAE's 4x compression."""
        per_second = config["audio_sampling_rate"] / config["audio_hop_length"] / config["audio_scale_factor"]
        return round(num_frames / frame_rate * per_second)

    @classmethod
    def _tokens(cls, resolution: int, num_frames: int, config) -> tuple[int, int, int, int]:
        """(latent frames, latent side, video tokens, audio tokens) of a square clip."""
        temporal, spatial, _ = config["vae_scale_factors"]
        frames, side = (num_frames - 1) // temporal + 1, resolution // spatial
        video = (frames // config["patch_size_t"]) * (side // config["patch_size"]) ** 2
        return frames, side, video, cls._audio_frames(num_frames, cls.frame_rate, config)

    @classmethod
    def memory_latent_shape(cls, model_cfg, config: dict) -> tuple[int, ...]:
        _, _, video, audio = cls._tokens(model_cfg.resolution, model_cfg.num_frames, config)
        return (video + audio, config["in_channels"])

    @classmethod
    def memory_image_tokens(cls, shape: tuple[int, ...]) -> int:
        """Every token of the latent (video and audio): each block carries both streams."""
        return shape[0]

    @classmethod
    def memory_text_dim(cls, config: dict) -> int:
        return config["caption_channels"]

    @classmethod
    def memory_narrow(cls, config: dict, heads: int, blocks: dict[str, int]) -> dict:
        """Both streams narrowed by the same factor; each stream's text and cross-modal widths follow its heads."""
        audio_heads = max(1, config["audio_num_attention_heads"] * heads // config["num_attention_heads"])
        return {"num_attention_heads": heads, **blocks, "cross_attention_dim": heads * config["attention_head_dim"],
                "audio_num_attention_heads": audio_heads,
                "audio_cross_attention_dim": audio_heads * config["audio_attention_head_dim"]}

    def _config(self) -> dict:
        c = dict(self.transformer.config)
        pipe = getattr(self, "pipe", None)
        if pipe is not None:  # the pipeline's own VAEs decide the geometry, as its __call__ does
            c["vae_scale_factors"] = (pipe.vae_temporal_compression_ratio, pipe.vae_spatial_compression_ratio,
                                      pipe.vae_spatial_compression_ratio)
            c.update(audio_sampling_rate=pipe.audio_sampling_rate, audio_hop_length=pipe.audio_hop_length,
                     audio_scale_factor=pipe.audio_vae_temporal_compression_ratio)
        return c

    def latent_shape(self, resolution: int) -> tuple[int, int]:
        c = self._config()
        if c["in_channels"] != c["audio_in_channels"]:
            raise ConfigError(f"model.pretrained: this LTX-2 transformer's video tokens are {c['in_channels']} wide and "
                              f"its audio tokens {c['audio_in_channels']}; flowrl carries both streams in one latent "
                              "and needs them equally wide (the published LTX-2 has 128 and 128)")
        _, _, video, audio = self._tokens(resolution, self.num_frames, c)
        return (video + audio, c["in_channels"])

    def image_seq_len(self, resolution: int) -> int:
        return self._tokens(resolution, self.num_frames, self._config())[2]

    def patch_pixels(self, resolution: int) -> int:
        c = self._config()
        return c["vae_scale_factors"][1] * c["patch_size"]

    def shift_mu(self, num_steps: int, resolution: int) -> float:
        """LTX2Pipeline's shift: linear in the video token count, 0.95 at 1024 tokens and 2.05 at 4096."""
        from ..samplers.schedules import dynamic_shift_mu

        c = self.scheduler_config
        return dynamic_shift_mu(self.image_seq_len(resolution), c.get("base_image_seq_len", 1024),
                                c.get("max_image_seq_len", 4096), c.get("base_shift", 0.95), c.get("max_shift", 2.05))

    def default_sigmas(self, num_steps: int, resolution: int) -> torch.Tensor:
        return self.linspace_shifted_sigmas(num_steps, resolution)

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int]]:
        """(B, S, C) -> the video tokens (B, S_v, C), the audio tokens (B, S_a, C) and the video's token grid
        (frames, rows, columns), in patches."""
        c = self._config()
        audio = self._audio_frames(self.num_frames, self.frame_rate, c)
        frames = ((self.num_frames - 1) // c["vae_scale_factors"][0] + 1) // c["patch_size_t"]
        side = round(((x.shape[1] - audio) / frames) ** 0.5)
        return x[:, : x.shape[1] - audio], x[:, x.shape[1] - audio:], (frames, side, side)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, S_v + S_a, C) -> videos (B, F, 3, H, W) in [0, 1]; the audio tokens are not decoded."""
        video, _, (frames, h, w) = self._split(latents.float())
        p, pt = self.transformer.config.patch_size, self.transformer.config.patch_size_t
        z = self.pipe._unpack_latents(video, frames, h, w, p, pt)  # (B, C, F', h, w)
        z = self.pipe._denormalize_latents(z, self.vae.latents_mean, self.vae.latents_std, self.vae.config.scaling_factor)
        # the pipeline's decode_timestep is 0 (its default): no noise is added before decoding
        timestep = z.new_zeros(1) if self.vae.config.timestep_conditioning else None
        # one video at a time, as the pipeline decodes one prompt's: the 3D convolutions round a batch's rows apart
        # from each row alone, and a sample's pixels should not depend on which samples share its decode
        out = torch.cat([self.vae.decode(z[i: i + 1].to(self.vae.dtype), timestep, return_dict=False)[0]
                         for i in range(z.shape[0])])
        return (out.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)  # (B, 3, F, H, W) -> (B, F, 3, H, W)

    # ---------------------------------------------------------------- text and velocity
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """Each prompt once through Gemma 3 (the pipeline's ``encode_prompt``) and the connectors: ``embeds`` (N, L, D)
        and ``mask`` (N, L) for the video stream, ``extra["audio_embeds"]`` (N, L, D) for the audio stream."""
        connectors = self.pipe.connectors
        for p in sorted({p for p in prompts if p not in self._cache}):
            embeds, mask, _, _ = self.pipe.encode_prompt(prompt=[str(p)], do_classifier_free_guidance=False,
                                                         max_sequence_length=self.max_sequence_length,
                                                         device=self.text_device)
            video, audio, joint_mask = connectors(embeds.to(connectors.dtype), mask,
                                                  padding_side=self.pipe.tokenizer.padding_side)
            self._cache[p] = tuple(t[0].float().to(self.device) for t in (video, audio, joint_mask))
        rows = [self._cache[p] for p in prompts]
        video, audio, mask = (torch.stack([r[k] for r in rows]) for k in range(3))
        return PromptEmbeds(video, video.new_zeros(len(prompts), 0), mask, extra={"audio_embeds": audio})

    def _forward(self, x, sigma, cond):
        video, audio, (frames, h, w) = self._split(x)
        p, pt = self.transformer.config.patch_size, self.transformer.config.patch_size_t
        extra = cond.extra or {}
        audio_text = extra.get("audio_embeds", cond.embeds)  # a replica without the pipeline: the same text tokens
        mask = cond.mask if cond.mask is not None else torch.ones(cond.embeds.shape[:2], device=x.device)
        t = (sigma * 1000.0).to(self.dtype)  # the pipeline passes the scheduler timestep as timestep and sigma
        v_video, v_audio = self.transformer(
            hidden_states=video.to(self.dtype), audio_hidden_states=audio.to(self.dtype),
            encoder_hidden_states=cond.embeds.to(self.dtype), audio_encoder_hidden_states=audio_text.to(self.dtype),
            timestep=t, sigma=t, encoder_attention_mask=mask.to(self.dtype),
            audio_encoder_attention_mask=mask.to(self.dtype), num_frames=frames * pt, height=h * p, width=w * p,
            fps=self.frame_rate, audio_num_frames=audio.shape[1], use_cross_timestep=self.use_cross_timestep,
            return_dict=False)
        return torch.cat([v_video, v_audio], dim=1).float()  # (B, S_v + S_a, C)
