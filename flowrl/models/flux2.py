"""FLUX.2 adapter (diffusers ``Flux2Transformer2DModel``): FLUX.2 [dev] through ``Flux2Pipeline`` (Mistral
text encoder) and FLUX.2 [klein] through ``Flux2KleinPipeline`` (Qwen3 text encoder); both give
``encode_prompt(prompt, device, max_sequence_length, text_encoder_out_layers) -> (embeds, text_ids)``.

FLUX.2 normalises latents with its VAE's batch-norm statistics and patchifies 2x2 before the transformer; the
engine works in that space, (4C, H/16, W/16), which is where the pipeline draws its noise, so the adapter only
flattens it to tokens. Decoding undoes the normalisation and the patchify. The grid is linspace(1, 1/T, T)
shifted by FLUX.2's empirical mu (a function of the token count and T).
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from .published import FLUX2_KLEIN_4B
from .common import JOINT_ATTENTION_LORA_TARGETS, PipelineAdapter

FLUX2_PRESETS = {"flux.2-dev": "black-forest-labs/FLUX.2-dev", "flux.2-klein-4b": "black-forest-labs/FLUX.2-klein-4B",
                 "flux.2-klein-base-4b": "black-forest-labs/FLUX.2-klein-base-4B"}
# the double blocks' attention projections and the single blocks' fused qkv + MLP input projection
FLUX2_LORA_TARGETS = JOINT_ATTENTION_LORA_TARGETS + ["attn.to_qkv_mlp_proj"]


def token_ids(h: int, w: int) -> torch.Tensor:
    """(H * W, 4) position ids (t, row, column, layer) of the latent tokens, Flux2Pipeline's order."""
    return torch.cartesian_prod(torch.arange(1), torch.arange(h), torch.arange(w), torch.arange(1))


class Flux2Adapter(PipelineAdapter):
    family = "flux2"
    transformer_class_name = "Flux2Transformer2DModel"
    published_architectures = {"black-forest-labs/FLUX.2-klein-4B": (FLUX2_KLEIN_4B, 1),
                               "black-forest-labs/FLUX.2-klein-base-4B": (FLUX2_KLEIN_4B, 1)}
    context_parallel_splits_text = True

    lora_targets = FLUX2_LORA_TARGETS
    text_encoder_names = ("text_encoder",)

    tiny_builder = "build_tiny_flux2_pipeline"
    tiny_patch_pixels = 4  # the tiny VAE's 2x downsampling x 2 x 2 patches
    presets = FLUX2_PRESETS
    pipeline_class_name = "DiffusionPipeline"  # FLUX.2 [dev] or [klein]: the checkpoint's model_index.json decides
    pipeline_label = "Flux2Pipeline` / `Flux2KleinPipeline"  # what the docs' family matrix shows
    family_options = ("guidance",)
    guidance = 4.0  # FLUX.2 [dev]'s guidance embedding (model.guidance); klein has none
    text_encoder_out_layers: tuple[int, ...] | None = None  # None: the pipeline's default layers

    @classmethod
    def memory_latent_shape(cls, model_cfg, config: dict) -> tuple[int, ...]:
        r = model_cfg.resolution // 16  # the engine's latents are already patchified 2x2: (4C, H / 16, W / 16)
        return (config.get("in_channels", 128), r, r)

    def __init__(self, pipe, *args, **kwargs):
        if type(pipe).__name__ not in ("Flux2Pipeline", "Flux2KleinPipeline"):
            raise ConfigError(f"model.pretrained: the checkpoint is a {type(pipe).__name__}, not a FLUX.2 pipeline; "
                              "set model.family to match it")
        super().__init__(pipe, *args, **kwargs)
        self.pipeline_class_name = type(pipe).__name__  # Flux2Pipeline or Flux2KleinPipeline: its LoRA format

    # ---------------------------------------------------------------- geometry, schedule, decoding
    def latent_shape(self, resolution: int) -> tuple[int, int, int]:
        f = 2 * self.vae_factor()  # VAE, then the 2x2 patchify
        return (self.transformer.config.in_channels, resolution // f, resolution // f)

    def image_seq_len(self, resolution: int) -> int:
        _, h, w = self.latent_shape(resolution)
        return h * w

    def shift_mu(self, num_steps: int, resolution: int) -> float:
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        return compute_empirical_mu(self.image_seq_len(resolution), num_steps)  # FLUX.2's fit in (tokens, T)

    def default_sigmas(self, num_steps: int, resolution: int) -> torch.Tensor:
        return self.linspace_shifted_sigmas(num_steps, resolution)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, 4C, h, w) normalised patchified latents -> (B, 3, H, W) in [0, 1]."""
        bn = self.vae.bn
        mean = bn.running_mean.view(1, -1, 1, 1).to(latents.device, torch.float32)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + self.vae.config.batch_norm_eps).to(latents.device, torch.float32)
        z = latents.float() * std + mean
        b, c4, h, w = z.shape  # unpatchify: (B, 4C, h, w) -> (B, C, 2h, 2w)
        z = z.reshape(b, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c4 // 4, 2 * h, 2 * w)
        image = self.vae.decode(z.to(self.vae.dtype), return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)

    # ---------------------------------------------------------------- text and velocity
    def _encode_one(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        kwargs = {} if self.text_encoder_out_layers is None else {"text_encoder_out_layers": self.text_encoder_out_layers}
        embeds, _ = self.pipe.encode_prompt(prompt=[prompt], device=self.text_device,
                                            max_sequence_length=self.max_sequence_length, **kwargs)
        return embeds[0], embeds.new_zeros(0)

    def _forward(self, x, sigma, cond):
        b, c, h, w = x.shape
        embeds = cond.embeds
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full((b,), self.guidance, device=x.device, dtype=torch.float32)
        t = (sigma * 1000.0).to(self.dtype)
        tokens = x.reshape(b, c, h * w).permute(0, 2, 1)  # (B, h w, 4C)
        txt_ids = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(embeds.shape[1]))
        out = self.transformer(
            hidden_states=tokens.to(self.dtype), timestep=t / 1000, guidance=guidance,
            encoder_hidden_states=embeds.to(self.dtype), txt_ids=txt_ids.expand(b, -1, -1).to(x.device),
            img_ids=token_ids(h, w).expand(b, -1, -1).to(x.device), return_dict=False,
        )[0]
        return out.float().permute(0, 2, 1).reshape(b, c, h, w)
