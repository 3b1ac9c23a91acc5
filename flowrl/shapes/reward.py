"""A verifiable reward for the shapes domain: background colour, shape colour and shape read from pixels.

- ``classify(image)`` -> (background, colour, shape) by nearest palette colour and template IoU.
- ``shapes`` reward (training): partial credit per attribute, mean of three scores in [0, 1]:
  the fraction of border pixels of the asked background colour, the fraction of foreground pixels of the asked
  shape colour, and the IoU of the foreground with the best-fitting template of the asked shape.
  With ``shape="margin"`` the shape part is (1 + IoU(asked) - best other IoU) / 2 instead.
- ``shapes_accuracy``: strict per-attribute correctness, for evaluation.
A prompt outside the domain's vocabulary raises an error: the reward cannot judge it.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import RewardError
from .domain import COLORS, SHAPES, ShapeSpec, parse_prompt, shape_mask

PALETTE = np.array(list(COLORS.values()), dtype=np.float32)  # (8, 3)
NAMES = list(COLORS)


def _to_uint8(images: torch.Tensor) -> np.ndarray:
    """(N, 3, H, W) in [0, 1] -> (N, H, W, 3) float32 in 0..255."""
    return (images.detach().float().cpu().clamp(0, 1) * 255).permute(0, 2, 3, 1).numpy()


def _nearest(img: np.ndarray) -> np.ndarray:
    """(H, W, 3) -> (H, W) index of the nearest palette colour."""
    d = ((img[:, :, None, :] - PALETTE[None, None]) ** 2).sum(-1)
    return d.argmin(-1)


def _border(idx: np.ndarray) -> np.ndarray:
    return np.concatenate([idx[0], idx[-1], idx[1:-1, 0], idx[1:-1, -1]])


def _shape_ious(mask: np.ndarray) -> dict[str, float]:
    """IoU of the mask with each shape template fitted to the mask's bounding box."""
    ys, xs = np.nonzero(mask)
    res = mask.shape[0]
    if ys.size < 4:
        return {s: 0.0 for s in SHAPES}
    top, left = ys.min(), xs.min()
    size0 = max(ys.max() - top + 1, xs.max() - left + 1)
    out = {}
    for shape in SHAPES:
        best = 0.0
        for size in (size0 - 1, size0, size0 + 1):
            if size < 3:
                continue
            tmpl = shape_mask(shape, size, res, top, left)
            inter = (tmpl & mask).sum()
            union = (tmpl | mask).sum()
            best = max(best, inter / union if union else 0.0)
        out[shape] = float(best)
    return out


def analyse(img: np.ndarray) -> dict:
    """Per-image readout: background, colour, shape, and the maps the scores need."""
    idx = _nearest(img)
    border = _border(idx)
    bg = int(np.bincount(border, minlength=len(NAMES)).argmax())
    fg = idx != bg
    counts = np.bincount(idx[fg], minlength=len(NAMES)) if fg.any() else np.zeros(len(NAMES), dtype=int)
    color = int(counts.argmax()) if fg.any() else -1
    mask = idx == color if color >= 0 else np.zeros_like(fg)
    ious = _shape_ious(mask)
    shape = max(ious, key=ious.get) if fg.any() else "none"
    return {"idx": idx, "border": border, "fg": fg, "background": NAMES[bg],
            "color": NAMES[color] if color >= 0 else "none", "shape": shape, "ious": ious}


def classify(images: torch.Tensor) -> list[tuple[str, str, str]]:
    """(N, 3, H, W) in [0, 1] -> [(background, colour, shape)]."""
    return [(a["background"], a["color"], a["shape"]) for a in map(analyse, _to_uint8(images))]


def _specs(prompts: list[str]) -> list[ShapeSpec]:
    specs = []
    for p in prompts:
        spec = parse_prompt(p)
        if spec is None:
            raise RewardError(
                f"the shapes reward cannot judge the prompt {p!r}: it must read 'a <colour> <shape> on a <colour> "
                f"background' with colours {', '.join(NAMES)} and shapes {', '.join(SHAPES)}")
        specs.append(spec)
    return specs


def score_row(out: dict, i: int, spec, read: dict, pixels: np.ndarray, ious: dict[str, float]) -> None:
    """Row ``i`` of the scores the image and video checkers share. ``read``: the checker's readout (``idx`` palette
    indices and ``border`` of the image or of every frame, the read background / colour / shape); ``pixels``:
    the 0..255 pixels ``idx`` indexes; ``ious``: the template IoUs of the asked colour's mask."""
    want_bg, want_color = NAMES.index(spec.background), NAMES.index(spec.color)
    idx = read["idx"]
    # cleanliness: RMS distance (0..255 per channel) of the pixels read as the asked background from that exact
    # colour; 0 for a flat background, and the texture GRPO can add to it raises it (the checker does not)
    on_bg = idx == want_bg
    if on_bg.any():
        out["bg_noise"][i] = float(np.sqrt(((pixels[on_bg] - PALETTE[want_bg]) ** 2).mean()))
    out["bg_score"][i] = float((read["border"] == want_bg).mean())
    fg = idx != want_bg
    out["color_score"][i] = float((idx[fg] == want_color).mean()) if fg.any() else 0.0
    out["shape_score"][i] = ious[spec.shape]
    # how far the asked shape's IoU is ahead of the best other shape's: > 0 exactly when the checker would read
    # the asked shape from that mask
    out["shape_margin"][i] = ious[spec.shape] - max(v for k, v in ious.items() if k != spec.shape)
    out["bg_ok"][i] = read["background"] == spec.background
    out["color_ok"][i] = read["color"] == spec.color
    out["shape_ok"][i] = read["shape"] == spec.shape


def attribute_scores(images: torch.Tensor, prompts: list[str]) -> dict[str, np.ndarray]:
    """Continuous per-attribute scores in [0, 1], strict correctness and background noise, each (N,)."""
    specs = _specs(prompts)
    out = {k: np.zeros(len(specs)) for k in ("bg_score", "color_score", "shape_score", "shape_margin", "bg_ok",
                                              "color_ok", "shape_ok", "bg_noise")}
    for i, (img, spec) in enumerate(zip(_to_uint8(images), specs)):
        a = analyse(img)
        score_row(out, i, spec, a, img, _shape_ious(a["idx"] == NAMES.index(spec.color)))
    return out


class ShapesReward:
    """Partial credit: mean of background, colour and shape scores (each in [0, 1]).

    ``shape="iou"``: the shape score is the IoU with the asked shape's template. ``shape="margin"``:
    (1 + IoU(asked) - max IoU(other shapes)) / 2, which rises exactly as the mask moves toward being read as
    the asked shape (a blob that grows more like every template gains IoU but no margin).

    ``background_noise_weight`` w > 0 subtracts w x background noise / 100 (the cleanliness metric, 0..255 per
    channel), so texture on flat backgrounds, which the checker's readout ignores, costs reward."""

    def __init__(self, shape: str = "iou", background_noise_weight: float = 0.0):
        if shape not in ("iou", "margin"):
            raise RewardError(f"shapes reward: shape={shape!r} must be 'iou' or 'margin'")
        if not background_noise_weight >= 0:
            raise RewardError(f"shapes reward: background_noise_weight={background_noise_weight!r} must be >= 0")
        self.shape, self.noise_weight = shape, float(background_noise_weight)

    def __call__(self, images, prompts, metadata=None):
        s = attribute_scores(images, prompts)
        shape = s["shape_score"] if self.shape == "iou" else (1 + s["shape_margin"]) / 2
        return (s["bg_score"] + s["color_score"] + shape) / 3 - self.noise_weight * s["bg_noise"] / 100


class ShapesAccuracy:
    """1 when background, colour and shape are all right, else 0 (GenEval-style strict check)."""

    def __call__(self, images, prompts, metadata=None):
        s = attribute_scores(images, prompts)
        return s["bg_ok"] * s["color_ok"] * s["shape_ok"]
