"""Image embeddings from a transformers vision backbone (DINOv2, DINOv3, a CLIP vision tower, ...): one pooled
vector per image, for methods that measure how different a group's samples are (GARDO's diversity-aware
advantages, DiverseGRPO's clusters, the hacking guard's diversity). The backbone's own image processor prepares the
images. The vector is a dual encoder's projected
image embedding (``get_image_features``: CLIP, SigLIP), else the model's ``pooler_output`` (the normalised CLS token
for DINOv2 / DINOv3), else the first token of ``last_hidden_state``. ``tiny-clip`` names the shipped shapes CLIP's
image tower (the shapes models' feature model).

:func:`diversity` is the one measure of how different a group's samples are, for the guard and for methods that log
it."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from flowrl.errors import RewardError

from .loading import resolve_pretrained_dir, to_pil


class _FramesAveraged:
    """``embedder(images)``: images (N, 3, H, W) in [0, 1], or videos (N, F, 3, H, W) whose frames' vectors are
    averaged -> (N, D) float32 on the CPU; a subclass embeds a batch of images in ``embed``."""

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        if images.ndim == 5:  # videos: every frame embedded, the frames' vectors averaged
            n, f = images.shape[:2]
            return self(images.flatten(0, 1)).view(n, f, -1).mean(1)
        return self.embed(images)


class ImageEmbedder(_FramesAveraged):
    """A transformers vision backbone's pooled vector per image (see the module text)."""

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

    def embed(self, images: torch.Tensor) -> torch.Tensor:  # (N, 3, H, W) -> (N, D)
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


TINY_CLIP = "tiny-clip"


class TinyClipEmbedder(_FramesAveraged):
    """The shipped tiny shapes CLIP's normalised image embeddings (64-d), for the shapes models."""

    def __init__(self):
        from .clip import ClipScore

        self.clip, self.name = ClipScore("tiny-shapes"), TINY_CLIP

    def embed(self, images: torch.Tensor) -> torch.Tensor:  # (N, 3, H, W) -> (N, 64)
        return self.clip.embed_images(images).cpu()


def image_embedder(name_or_path: str):
    """The embedder a key names: ``tiny-clip`` (shipped), else a transformers vision backbone (folder or hub id)."""
    return TinyClipEmbedder() if name_or_path == TINY_CLIP else ImageEmbedder(name_or_path)


def pixel_embeddings(images: torch.Tensor) -> torch.Tensor:
    """(N, D) the images (videos: frames averaged) area-downsampled to 32 x 32, flattened; distances between them are
    RMS pixel differences once divided by sqrt(D)."""
    if images.ndim == 5:
        return pixel_embeddings(images.flatten(0, 1)).view(images.shape[0], images.shape[1], -1).mean(1)
    small = F.interpolate(images.float(), size=(32, 32), mode="area")
    return small.flatten(1) / math.sqrt(small[0].numel())


def group_diversity(embeddings: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean pairwise Euclidean distance among the embeddings (N, D) of each group (``labels`` (N,)), averaged over the
    groups of two or more. Identical samples give 0."""
    values = []
    for g in labels.unique().tolist():
        e = embeddings[labels == g].double()
        if len(e) < 2:
            continue
        d = torch.cdist(e, e, compute_mode="donot_use_mm_for_euclid_dist")  # exact: identical samples give 0
        values.append(float(d.sum() / (len(e) * (len(e) - 1))))
    return sum(values) / len(values) if values else 0.0


def diversity(embeddings: torch.Tensor, groups: int) -> float:
    """:func:`group_diversity` of ``groups`` prompt-major groups of N / groups samples each."""
    per = embeddings.shape[0] // groups
    return group_diversity(embeddings[:groups * per], torch.arange(groups * per) // per)
