"""A verifiable, motion-aware reward for the moving-shapes video domain: background, shape colour, shape and
motion direction read back from the frames.

Every frame is read as the image checker reads an image (nearest palette colour, template IoU); then
- background: the majority colour of every frame's border; shape colour: the majority non-background colour;
- shape: the template with the best IoU averaged over the frames;
- motion: the shape's centroid per frame; its mean step (last - first) / (F - 1) is projected on each direction,
  and the direction read is the largest projection when it is at least half the domain's speed (else "still").

``moving_shapes`` reward (training): the mean of four scores in [0, 1]: the border fraction of the asked
background, the foreground fraction of the asked colour, the shape margin (1 + IoU(asked) - best other IoU) / 2,
and the motion score (1 + clip((along - |across|) / SPEED, -1, 1)) / 2 with ``along`` the mean step along the asked
direction and ``across`` the one across it. A prompt outside the vocabulary raises an error.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import RewardError
from .domain import COLORS, SHAPES
from .moving import DIRECTIONS, SPEED, MovingSpec, parse_prompt
from .reward import _border, _nearest, _shape_ious, score_row

NAMES = list(COLORS)


def _to_uint8(videos: torch.Tensor) -> np.ndarray:
    """(N, F, 3, H, W) in [0, 1] -> (N, F, H, W, 3) float32 in 0..255."""
    if videos.dim() != 5:
        raise RewardError(f"the moving_shapes reward reads videos (N, F, 3, H, W); got a tensor of shape "
                          f"{tuple(videos.shape)}")
    return (videos.detach().float().cpu().clamp(0, 1) * 255).permute(0, 1, 3, 4, 2).numpy()


def read_clip(clip: np.ndarray, want_color: int | None = None) -> dict:
    """Readout of one clip (F, H, W, 3) in 0..255: background, colour, mean shape IoUs and the centroid step.
    ``want_color`` fixes the colour whose mask is measured (the asked one, for scoring)."""
    idx = np.stack([_nearest(f) for f in clip])  # (F, H, W) palette indices
    border = np.concatenate([_border(i) for i in idx])
    bg = int(np.bincount(border, minlength=len(NAMES)).argmax())
    fg = idx != bg
    color = int(np.bincount(idx[fg], minlength=len(NAMES)).argmax()) if fg.any() else -1
    mask_color = color if want_color is None else want_color
    masks = idx == mask_color  # (F, H, W)
    per_frame = [_shape_ious(m) for m in masks]
    ious = {s: float(np.mean([p[s] for p in per_frame])) for s in SHAPES}
    centroids = [np.argwhere(m).mean(0) if m.any() else None for m in masks]  # (y, x) per frame
    step = np.zeros(2)
    if centroids[0] is not None and centroids[-1] is not None and len(centroids) > 1:
        step = (centroids[-1] - centroids[0]) / (len(centroids) - 1)
    projections = {d: float(step @ np.array(v)) for d, v in DIRECTIONS.items()}
    direction = max(projections, key=projections.get)
    if projections[direction] < SPEED / 2:
        direction = "still"
    return {"idx": idx, "border": border, "background": NAMES[bg], "color": NAMES[color] if color >= 0 else "none",
            "shape": max(ious, key=ious.get) if masks.any() else "none", "ious": ious, "step": step,
            "direction": direction}


def classify(videos: torch.Tensor) -> list[tuple[str, str, str, str]]:
    """(N, F, 3, H, W) in [0, 1] -> [(background, colour, shape, direction)]."""
    return [(r["background"], r["color"], r["shape"], r["direction"]) for r in map(read_clip, _to_uint8(videos))]


def _specs(prompts: list[str]) -> list[MovingSpec]:
    specs = []
    for p in prompts:
        spec = parse_prompt(p)
        if spec is None:
            raise RewardError(
                f"the moving_shapes reward cannot judge the prompt {p!r}: it must read 'a <colour> <shape> moving "
                f"<direction> on a <colour> background' with colours {', '.join(NAMES)}, shapes {', '.join(SHAPES)} "
                f"and directions {', '.join(DIRECTIONS)}")
        specs.append(spec)
    return specs


SCORE_KEYS = ("bg_score", "color_score", "shape_score", "shape_margin", "motion_score", "bg_ok", "color_ok",
              "shape_ok", "motion_ok", "bg_noise")


def attribute_scores(videos: torch.Tensor, prompts: list[str]) -> dict[str, np.ndarray]:
    """Continuous per-attribute scores in [0, 1], strict correctness and background noise, each (N,)."""
    specs = _specs(prompts)
    out = {k: np.zeros(len(specs)) for k in SCORE_KEYS}
    for i, (clip, spec) in enumerate(zip(_to_uint8(videos), specs)):
        read = read_clip(clip)
        asked = read_clip(clip, NAMES.index(spec.color)) if read["color"] != spec.color else read
        score_row(out, i, spec, read, clip, asked["ious"])
        dy, dx = DIRECTIONS[spec.direction]
        along = float(asked["step"] @ np.array([dy, dx]))
        across = float(abs(asked["step"] @ np.array([dx, dy])))
        out["motion_score"][i] = (1 + np.clip((along - across) / SPEED, -1, 1)) / 2
        out["motion_ok"][i] = read["direction"] == spec.direction
    return out


class MovingShapesReward:
    """Partial credit for videos: mean of background, colour, shape-margin and motion scores (each in [0, 1])."""

    def __call__(self, videos, prompts, metadata=None):
        s = attribute_scores(videos, prompts)
        return (s["bg_score"] + s["color_score"] + (1 + s["shape_margin"]) / 2 + s["motion_score"]) / 4


class MovingShapesAccuracy:
    """1 when background, colour, shape and motion direction are all right, else 0."""

    def __call__(self, videos, prompts, metadata=None):
        s = attribute_scores(videos, prompts)
        return s["bg_ok"] * s["color_ok"] * s["shape_ok"] * s["motion_ok"]
