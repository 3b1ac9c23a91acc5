"""Qwen-Image adapter (diffusers ``QwenImageTransformer2DModel``).

As for FLUX, latents stay unpacked in the engine, (C, H/8, W/8) (the Qwen-Image VAE's frame axis of one is
added only to decode), and the adapter packs 2x2 patches into tokens inside its transformer call. The text
encoder is Qwen2.5-VL: a prompt encodes to as many tokens as it has (no padding to a fixed length), so a
batch is padded to its longest prompt with an attention mask. True CFG is Qwen-Image's: the guided velocity
is rescaled per token to the norm of the conditional one. The schedule is the pipeline's linspace(1, 1/T, T)
with the resolution-dependent shift.
"""

from __future__ import annotations

import torch

from .published import QWEN_IMAGE
from .common import JOINT_ATTENTION_LORA_TARGETS, PipelineAdapter, PromptEmbeds
from .flux import pack, unpack

QWEN_PRESETS = {"qwen-image": "Qwen/Qwen-Image"}
QWEN_LORA_TARGETS = JOINT_ATTENTION_LORA_TARGETS  # its dual-stream blocks name them as SD3 and FLUX do


class QwenImageAdapter(PipelineAdapter):
    family = "qwenimage"
    pipeline_class_name = "QwenImagePipeline"
    transformer_class_name = "QwenImageTransformer2DModel"
    published_architectures = {"Qwen/Qwen-Image": (QWEN_IMAGE, 1)}
    context_parallel_splits_text = True

    lora_targets = QWEN_LORA_TARGETS
    text_encoder_names = ("text_encoder",)
    variable_length = True

    tiny_builder = "build_tiny_qwenimage_pipeline"
    tiny_patch_pixels = 4  # the tiny VAE's 2x downsampling x 2 x 2 patches
    tiny_sequence_length = False  # the pipeline keeps a prompt template ahead of the prompt
    presets = QWEN_PRESETS

    @classmethod
    def memory_latent_shape(cls, model_cfg, config: dict) -> tuple[int, ...]:
        r = model_cfg.resolution // 8
        return (config.get("out_channels", 16), r, r)  # the VAE's channels (the transformer's input is packed)

    # ---------------------------------------------------------------- geometry, schedule, decoding
    def vae_factor(self) -> int:
        return 2 ** len(self.vae.temperal_downsample)

    def latent_shape(self, resolution: int) -> tuple[int, int, int]:
        f = self.vae_factor()
        return (self.vae.config.z_dim, resolution // f, resolution // f)

    def default_sigmas(self, num_steps: int, resolution: int) -> torch.Tensor:
        return self.linspace_shifted_sigmas(num_steps, resolution)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, C, h, w) -> (B, 3, H, W) in [0, 1]: un-normalise with the VAE's per-channel mean and std."""
        c = self.vae.config
        mean = torch.tensor(c.latents_mean, device=latents.device).view(1, c.z_dim, 1, 1, 1)
        std = torch.tensor(c.latents_std, device=latents.device).view(1, c.z_dim, 1, 1, 1)
        z = latents[:, :, None].float() * std + mean  # (B, C, 1, h, w): one frame
        image = self.vae.decode(z.to(self.vae.dtype), return_dict=False)[0][:, :, 0]
        return (image.float() / 2 + 0.5).clamp(0, 1)

    # ---------------------------------------------------------------- text and velocity
    def _encode_one(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, _ = self.pipe.encode_prompt(prompt=[prompt], device=self.text_device,
                                            max_sequence_length=self.max_sequence_length)
        return embeds[0], embeds.new_zeros(0)

    def _forward(self, x, sigma, cond: PromptEmbeds) -> torch.Tensor:
        b, _, h, w = x.shape
        mask = cond.mask if cond.mask is not None else torch.ones(cond.embeds.shape[:2], dtype=torch.long,
                                                                  device=x.device)
        t = (sigma * 1000.0).to(self.dtype)  # the pipeline's scheduler timestep, which it divides by 1000
        out = self.transformer(
            hidden_states=pack(x).to(self.dtype), timestep=t / 1000, encoder_hidden_states=cond.embeds.to(self.dtype),
            encoder_hidden_states_mask=mask, img_shapes=[[(1, h // 2, w // 2)]] * b, return_dict=False,
        )[0]
        return unpack(out.float(), h, w)

    def _guide(self, v_neg, v_pos, guidance_scale):
        """QwenImagePipeline's true CFG: ``v_neg + g (v_pos - v_neg)`` rescaled per packed token (the 4C values
        of one 2x2 patch) to the norm of ``v_pos``."""
        h, w = v_pos.shape[-2:]
        pos, neg = pack(v_pos), pack(v_neg)  # (B, h/2 * w/2, 4C)
        comb = neg + guidance_scale * (pos - neg)
        return unpack(comb * (pos.norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True)), h, w)
