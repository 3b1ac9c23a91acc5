"""Qwen-Image-Edit adapter (diffusers ``QwenImageEditPipeline``): image editing with Qwen-Image's transformer.

Each prompt is an edit request (:class:`flowrl.editing.EditPrompt`) whose source image conditions the model twice,
as the pipeline does:

- Qwen2.5-VL reads the source with the instruction (the pipeline's template, its vision tokens filled by the
  processor), so the text embedding itself depends on the source;
- the source's VAE latents (normalised with the VAE's per-channel statistics), packed into 2 x 2 tokens, follow the
  noisy image's tokens in every transformer call, and the velocity is read off the image's own tokens.

The pipeline resizes a source to about one megapixel (1024 x 1024 for a square one) whatever the output size; the
adapter reads sources at ``source_side`` pixels (1024; the tiny model's own resolution). True CFG encodes the negative
prompt with each request's source too: once the sampler has encoded its negative prompt, every request's batch also
carries that prompt encoded with the request's source (``extra``), which the negative half of CFG uses, with
Qwen-Image's norm-rescaled combination.
"""

from __future__ import annotations

import torch

from ..editing import EditPrompt, load_source, sources_of
from .common import PromptEmbeds
from .flux import pack, unpack
from .published import QWEN_IMAGE
from .qwenimage import QwenImageAdapter


class QwenImageEditAdapter(QwenImageAdapter):
    family = "qwenimage-edit"
    pipeline_class_name = "QwenImageEditPipeline"
    published_architectures = {"Qwen/Qwen-Image-Edit": (QWEN_IMAGE, 1)}
    presets = {"qwen-image-edit": "Qwen/Qwen-Image-Edit"}
    tiny_builder = "build_tiny_qwenimage_edit_pipeline"
    edits = True
    text_reads_sources = True  # Qwen2.5-VL reads the source with the instruction
    source_side = 1024  # pixels per side of a (square) source, as the pipeline resizes it

    @classmethod
    def memory_source_shape(cls, model_cfg, config: dict) -> tuple[int, ...]:
        """The source's latents at ``source_side`` (1024 px: 128 x 128 latents, 4,096 tokens) whatever the output."""
        r = cls.source_side // 8
        return (config.get("out_channels", 16), r, r)

    def source_pixels(self) -> int:
        return self.source_side

    def __init__(self, pipe, **kwargs):
        super().__init__(pipe, **kwargs)
        self.negative_text: str | None = None  # the sampler's negative prompt, once it has encoded it

    # ---------------------------------------------------------------- text with the source, and the source's latents
    def _encode_one(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        keys = sources_of(prompt)
        images = [load_source(keys[0], self.source_side)] if keys else None
        embeds, _ = self.pipe.encode_prompt(prompt=[str(prompt)], image=images, device=self.text_device,
                                            max_sequence_length=self.max_sequence_length)
        return embeds[0], embeds.new_zeros(0)

    def _encode_source_images(self, images: list) -> torch.Tensor:
        """(K, C, h, w): the pipeline's preprocessing at ``source_side``, the VAE's mode, normalised per channel."""
        c = self.vae.config
        pixels = torch.cat([self.pipe.image_processor.preprocess(img, self.source_side, self.source_side)
                            for img in images])[:, :, None]  # (K, 3, 1, H, W): one frame
        z = self.vae.encode(pixels.to(device=self.vae.device, dtype=self.vae.dtype)).latent_dist.mode()
        mean = torch.tensor(c.latents_mean, device=z.device).view(1, c.z_dim, 1, 1, 1)
        std = torch.tensor(c.latents_std, device=z.device).view(1, c.z_dim, 1, 1, 1)
        return ((z - mean) / std)[:, :, 0]

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """Edit requests as every editing family encodes them, plus (once the negative prompt is known) the negative
        prompt read with each request's source, in ``extra`` (``negative_embeds``, ``negative_mask``). A batch of plain
        prompts is the sampler's negative prompt: it is remembered."""
        if prompts and not any(sources_of(p) for p in prompts):
            # plain prompts (the sampler's negative prompt; "a" where a shape is all that is asked): the text encoder
            # needs an image, so they are read with a black one; CFG's negative half reads each row's own source
            if self.negative_text is None:
                self.negative_text = str(prompts[0])
            from PIL import Image

            from ..editing import remember_image

            blank = remember_image(Image.new("RGB", (self.source_pixels(),) * 2))
            prompts = [EditPrompt(str(p), [blank]) for p in prompts]
        batch = super().encode_prompts(prompts)
        if self.negative_text is None or batch.reference is None:
            return batch
        negative = super().encode_prompts([EditPrompt(self.negative_text, sources_of(p)) for p in prompts])
        mask = negative.mask if negative.mask is not None else torch.ones(negative.embeds.shape[:2],
                                                                          dtype=torch.long, device=negative.embeds.device)
        batch.extra = {"negative_embeds": negative.embeds, "negative_mask": mask}
        return batch

    def velocity(self, x, sigma, cond, guidance_scale=1.0, negative=None, unconditional_grad=True):
        """As every family's; CFG's negative half uses each row's negative prompt read with that row's source."""
        if negative is not None and cond.extra is not None and "negative_embeds" in cond.extra:
            negative = PromptEmbeds(cond.extra["negative_embeds"], cond.pooled, cond.extra["negative_mask"],
                                    cond.reference, cond.extra)
        return super().velocity(x, sigma, cond, guidance_scale, negative, unconditional_grad)

    def _forward(self, x, sigma, cond: PromptEmbeds) -> torch.Tensor:
        b, _, h, w = x.shape
        ref = cond.reference  # (B, K, C, h_r, w_r) the K sources' latents
        if ref is None:
            raise ValueError(f"{self.family} needs each prompt's source image (an edit request); none was encoded")
        hr, wr = ref.shape[-2:]
        mask = cond.mask if cond.mask is not None else torch.ones(cond.embeds.shape[:2], dtype=torch.long,
                                                                  device=x.device)
        # (B, hw/4 + K h_r w_r/4, 4C): the image's tokens, then each source's, in the request's order
        tokens = torch.cat([pack(x), *[pack(ref[:, k]) for k in range(ref.shape[1])]], dim=1)
        t = (sigma * 1000.0).to(self.dtype)
        out = self.transformer(
            hidden_states=tokens.to(self.dtype), timestep=t / 1000, encoder_hidden_states=cond.embeds.to(self.dtype),
            encoder_hidden_states_mask=mask,
            img_shapes=[[(1, h // 2, w // 2), *[(1, hr // 2, wr // 2)] * ref.shape[1]]] * b, return_dict=False,
        )[0]
        return unpack(out[:, : (h // 2) * (w // 2)].float(), h, w)


class QwenImageEditPlusAdapter(QwenImageEditAdapter):
    """Qwen-Image-Edit-2509 / 2511 (diffusers ``QwenImageEditPlusPipeline``): one to three source images per request.

    As Qwen-Image-Edit, with the pipeline's differences: the instruction follows one "Picture i:" vision block per
    source; Qwen2.5-VL reads each source at about 384 x 384 pixels (``condition_side``) and the VAE at about one
    megapixel (``source_side``, 1024 x 1024 for a square source); every source's packed latents follow the image's
    tokens, in the request's order, each with its own position grid."""

    family = "qwenimage-edit-plus"
    pipeline_class_name = "QwenImageEditPlusPipeline"
    published_architectures = {"Qwen/Qwen-Image-Edit-2509": (QWEN_IMAGE, 1)}
    presets = {"qwen-image-edit-2509": "Qwen/Qwen-Image-Edit-2509", "qwen-image-edit-2511": "Qwen/Qwen-Image-Edit-2511"}
    tiny_builder = "build_tiny_qwenimage_edit_plus_pipeline"
    max_sources = 3  # the pipeline's card: one to three input images work best
    condition_side = 384  # pixels per side of a (square) source as the text encoder reads it

    def _encode_one(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        images = [load_source(key, self.condition_side) for key in sources_of(prompt)] or None
        embeds, _ = self.pipe.encode_prompt(prompt=[str(prompt)], image=images, device=self.text_device,
                                            max_sequence_length=self.max_sequence_length)
        return embeds[0], embeds.new_zeros(0)
