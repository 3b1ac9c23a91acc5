"""Rewards for image editing that keep the source: how much of the source an edit preserved, and an instruction
reward gated by it.

- ``preservation``: in [0, 1], 1 for the source unchanged. Its pixel term is one minus the mean absolute difference
  (over channels and pixels, images in [0, 1]) between the result and the source, over the pixels the edit should
  leave alone: outside the row's mask where the data gives one (``metadata[mask_field]``, an image whose white
  pixels mark the region the edit may change), else every pixel. Its embedding term, with ``embedder`` (a
  transformers vision backbone, as GARDO's diversity uses), is the cosine similarity of the two images' embeddings,
  clipped at 0. With both, ``embedding_weight`` mixes them.
- ``edit_gate``: an instruction-following reward that counts only while the edit preserves the source. Below
  ``floor`` preservation the reward is ``below``; from ``threshold`` up it is the instruction reward; linearly
  between (``floor == threshold``, the default, is a hard gate). A weighted sum would let a large instruction gain
  pay for repainting the whole image, which is what instruction rewards reward; the gate makes preservation a
  constraint, so the only way up is a better edit of what was asked. ``mode: sum`` gives the weighted sum, to compare.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from flowrl.editing import source_tensor
from flowrl.errors import RewardError


def pixel_preservation(result: torch.Tensor, source: torch.Tensor, editable: torch.Tensor | None = None) -> torch.Tensor:
    """(N,) one minus the mean absolute difference of (N, 3, H, W) images in [0, 1] over the pixels outside
    ``editable`` ((N, H, W) bool, True where the edit may change the image; None: every pixel counts). A row whose
    mask covers every pixel scores 1."""
    diff = (result.float() - source.float()).abs().mean(1)  # (N, H, W)
    keep = torch.ones_like(diff, dtype=torch.bool) if editable is None else ~editable
    counted = keep.flatten(1).sum(1)
    changed = (diff * keep).flatten(1).sum(1)
    return torch.where(counted > 0, 1 - changed / counted.clamp(min=1), torch.ones_like(changed))


def load_mask(path: str, size: tuple[int, int]) -> torch.Tensor:
    """(H, W) bool: True where the mask image (white = editable) is brighter than mid-gray, resized (nearest) to
    ``size``."""
    from PIL import Image

    try:
        with Image.open(path) as img:
            gray = img.convert("L").resize((size[1], size[0]), resample=Image.NEAREST)
    except (OSError, ValueError) as exc:
        raise RewardError(f"preservation: cannot read mask {path} ({type(exc).__name__})") from exc
    return torch.from_numpy(np.asarray(gray) > 127)


class Preservation:
    """How much of each result's source (its edit request's first source image) the edit kept, in [0, 1].

    Args:
        embedder: "" for the pixel term only, else a vision backbone (a local folder or hub id) for the embedding term.
        embedding_weight: the embedding term's share where both are used.
        mask_field: the metadata field naming a row's mask image (white: the region the edit may change).
    """

    def __init__(self, embedder: str = "", embedding_weight: float = 0.5, mask_field: str = "mask"):
        if not 0 <= embedding_weight <= 1:
            raise RewardError(f"preservation: embedding_weight={embedding_weight} must be in [0, 1]")
        self.embedding_weight = embedding_weight if embedder else 0.0
        self.mask_field = mask_field
        self.embedder = None
        if embedder:
            from .embedding import ImageEmbedder

            self.embedder = ImageEmbedder(embedder)

    def __call__(self, images, prompts, metadata=None):
        images = images.detach().float().cpu()
        if images.ndim != 4:
            raise RewardError("preservation scores edited images (N, 3, H, W)")
        source = source_tensor(prompts, images.shape[-1])
        if source.shape[-2:] != images.shape[-2:]:
            source = F.interpolate(source, size=images.shape[-2:], mode="bilinear", antialias=True)
        metadata = metadata or [{} for _ in prompts]
        masks = [m.get(self.mask_field) for m in metadata]
        editable = None
        if any(masks):
            editable = torch.stack([load_mask(m, images.shape[-2:]) if m else torch.zeros(images.shape[-2:], dtype=torch.bool)
                                    for m in masks])
        score = pixel_preservation(images, source, editable)
        if self.embedder is not None:
            cos = F.cosine_similarity(self.embedder(images), self.embedder(source), dim=-1).clamp(min=0)
            score = (1 - self.embedding_weight) * score + self.embedding_weight * cos
        return score.double().numpy()


class EditGate:
    """An instruction reward gated by preservation (see the module's text).

    Args:
        instruction: the instruction-following reward, ``{name: ..., args: {...}}``.
        preservation: the preservation reward's arguments (see :class:`Preservation`), or another reward in [0, 1]
            that measures what the edit kept, ``{name: ..., args: {...}}`` (a task's own check).
        threshold: preservation at and above which the instruction reward counts in full.
        floor: preservation at and below which the reward is ``below`` (default: ``threshold``, a hard gate).
        below: the reward of an edit that does not preserve the source; keep it under the instruction reward's range.
        mode: ``gate`` or ``sum`` (``instruction_weight`` x instruction + (1 - it) x preservation, to compare).
        instruction_weight: the instruction reward's weight in ``sum`` mode.
    """

    def __init__(self, instruction: dict, preservation: dict | None = None, threshold: float = 0.9,
                 floor: float | None = None, below: float = 0.0, mode: str = "gate", instruction_weight: float = 0.5):
        from .registry import build_reward

        if mode not in ("gate", "sum"):
            raise RewardError(f"edit_gate: mode={mode!r} must be 'gate' or 'sum'")
        floor = threshold if floor is None else floor
        if not 0 <= floor <= threshold <= 1:
            raise RewardError(f"edit_gate: need 0 <= floor ({floor}) <= threshold ({threshold}) <= 1")
        if not isinstance(instruction, dict) or "name" not in instruction:
            raise RewardError("edit_gate: instruction must be {name: <reward>, args: {...}}")
        self.instruction = build_reward(instruction["name"], **instruction.get("args", {}))
        preservation = preservation or {}
        if "name" in preservation:
            self.preservation = build_reward(preservation["name"], **preservation.get("args", {}))
        else:
            self.preservation = Preservation(**preservation)
        self.threshold, self.floor, self.below, self.mode = threshold, floor, below, mode
        self.instruction_weight = instruction_weight

    def __call__(self, images, prompts, metadata=None):
        follow = np.asarray(self.instruction(images, prompts, metadata), dtype=np.float64)
        kept = np.asarray(self.preservation(images, prompts, metadata), dtype=np.float64)
        if self.mode == "sum":
            return self.instruction_weight * follow + (1 - self.instruction_weight) * kept
        if self.threshold == self.floor:
            open_ = (kept >= self.threshold).astype(np.float64)
        else:
            open_ = np.clip((kept - self.floor) / (self.threshold - self.floor), 0.0, 1.0)
        return self.below + (follow - self.below) * open_
