"""Image embeddings from a transformers vision backbone (DINOv2, DINOv3, a CLIP vision tower, ...): one pooled
vector per image, for methods that measure how different a group's samples are (GARDO's diversity-aware
advantages). The backbone's own image processor prepares the images. The vector is a dual encoder's projected
image embedding (``get_image_features``: CLIP, SigLIP), else the model's ``pooler_output`` (the normalised CLS token
for DINOv2 / DINOv3), else the first token of ``last_hidden_state``."""

from __future__ import annotations

import torch

from flowrl.errors import RewardError

from .loading import resolve_pretrained_dir, to_pil


class ImageEmbedder:
    """``embedder(images)``: images (N, 3, H, W) in [0, 1], or videos (N, F, 3, H, W) whose frames' vectors are
    averaged -> (N, D) float32 on the CPU."""

    def __init__(self, name_or_path: str, device: str | None = None):
        path = resolve_pretrained_dir("image embedder", name_or_path,
                                      "config.json, model.safetensors and preprocessor_config.json")
        from transformers import AutoImageProcessor, AutoModel

        try:
            self.processor = AutoImageProcessor.from_pretrained(path)
            model = AutoModel.from_pretrained(path, use_safetensors=True)
        except (OSError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RewardError(f"image embedder {name_or_path}: {first}"[:500]) from exc
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.name = name_or_path

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        if images.ndim == 5:  # videos: every frame embedded, the frames' vectors averaged
            n, f = images.shape[:2]
            return self(images.flatten(0, 1)).view(n, f, -1).mean(1)
        pixels = self.processor(images=to_pil(images.detach().float().cpu()), return_tensors="pt")["pixel_values"]
        pixels = pixels.to(self.device, self.model.dtype)
        if hasattr(self.model, "get_image_features"):  # a dual encoder: its projected image embedding
            out = self.model.get_image_features(pixel_values=pixels)
            pooled = out if torch.is_tensor(out) else out.pooler_output
        else:
            out = self.model(pixel_values=pixels)
            pooled = getattr(out, "pooler_output", None)
            pooled = out.last_hidden_state[:, 0] if pooled is None else pooled  # (N, D)
        return pooled.flatten(1).float().cpu()
