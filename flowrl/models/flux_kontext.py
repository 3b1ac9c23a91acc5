"""FLUX.1 Kontext adapter (diffusers ``FluxKontextPipeline``): image editing with FLUX.1's transformer.

Each prompt is an edit request (:class:`flowrl.editing.EditPrompt`). Its source image, resized to
``model.resolution``, is encoded once by the VAE (the distribution's mode, shifted and scaled) and kept beside the
text embeddings; every transformer call appends its packed tokens after the noisy image's, with position ids whose
first coordinate is 1, and reads the velocity off the image's own tokens, as ``FluxKontextPipeline`` does. The
schedule, the distilled guidance (3.5) and the LoRA format are FLUX.1's. The pipeline resizes a source to one of
Kontext's preferred resolutions by default; here it is resized to ``model.resolution`` (the pipeline's
``_auto_resize=False`` with ``height = width = model.resolution``).
"""

from __future__ import annotations

from .flux import FLUX_LORA_TARGETS, FluxAdapter, image_ids, pack
from .published import FLUX1_DEV


class FluxKontextAdapter(FluxAdapter):
    family = "flux-kontext"
    pipeline_class_name = "FluxKontextPipeline"
    published_architectures = {"black-forest-labs/FLUX.1-Kontext-dev": (FLUX1_DEV, 1)}
    presets = {"flux.1-kontext-dev": "black-forest-labs/FLUX.1-Kontext-dev"}
    lora_targets = FLUX_LORA_TARGETS
    tiny_builder = "build_tiny_flux_kontext_pipeline"
    edits = True

    def reference_tokens(self, cond):
        ref = cond.reference  # (B, 1, C, h, w) the source image's latents
        if ref is None:
            raise ValueError("FLUX.1 Kontext needs each prompt's source image (an edit request); none was encoded")
        r = ref[:, 0]
        ids = image_ids(*r.shape[-2:])
        ids[:, 0] = 1  # the source's tokens: the noisy image's position ids with the first coordinate set to 1
        return pack(r), ids
