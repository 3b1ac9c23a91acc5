"""The "moving shapes" video domain: one coloured shape on a coloured background, moving in a stated direction.

Captions read "a red circle moving left on a blue background". 4 shapes x 8 colours x 7 other background colours x
4 directions = 896 captions; a fixed, seeded subset of them is held out (never seen in pretraining) and every
shape, colour, background and direction still appears in the training captions. Clips are ``FRAMES`` frames of
``RESOLUTION`` px, rendered without anti-aliasing so that the pixel checker (``moving_shapes`` reward) is exact on
ground truth. The shape keeps its size and moves ``SPEED`` px per frame, so the whole path stays inside the frame.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from .domain import COLORS, SHAPES, article, shape_mask

DIRECTIONS = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}  # (dy, dx) per step
RESOLUTION = 20
FRAMES = 4
SPEED = 2  # pixels per frame
SIZES = (7, 10)  # shape side, inclusive range
NUM_HELDOUT = 48
SPLIT_SEED = 4321


@dataclass(frozen=True)
class MovingSpec:
    shape: str
    color: str
    background: str
    direction: str

    @property
    def prompt(self) -> str:
        return (f"{article(self.color)} {self.color} {self.shape} moving {self.direction} on {article(self.background)} "
                f"{self.background} background")


def all_specs() -> list[MovingSpec]:
    return [MovingSpec(s, c, b, d) for s in SHAPES for c in COLORS for b in COLORS if b != c for d in DIRECTIONS]


def split_specs() -> tuple[list[MovingSpec], list[MovingSpec]]:
    """(train, held-out): a seeded choice of NUM_HELDOUT captions, re-drawn until every attribute value remains
    in the training split."""
    specs = all_specs()
    rng = random.Random(SPLIT_SEED)
    while True:
        held = set(rng.sample(range(len(specs)), NUM_HELDOUT))
        train = [s for i, s in enumerate(specs) if i not in held]
        if all({getattr(s, a) for s in train} == {getattr(s, a) for s in specs}
               for a in ("shape", "color", "background", "direction")):
            return train, [specs[i] for i in sorted(held)]


def parse_prompt(prompt: str) -> MovingSpec | None:
    """Inverse of ``MovingSpec.prompt``; None when the prompt is outside the domain's vocabulary."""
    words = prompt.strip().lower().rstrip(".").split()
    if len(words) != 9 or words[0] not in ("a", "an") or words[3] != "moving" or words[5] != "on" \
            or words[6] not in ("a", "an") or words[8] != "background":
        return None
    color, shape, direction, background = words[1], words[2], words[4], words[7]
    if color not in COLORS or background not in COLORS or shape not in SHAPES or direction not in DIRECTIONS \
            or color == background:
        return None
    return MovingSpec(shape, color, background, direction)


def render_video(spec: MovingSpec, res: int = RESOLUTION, frames: int = FRAMES, seed: int = 0) -> np.ndarray:
    """uint8 clip (F, res, res, 3). Size and start position are drawn from ``seed``; every frame keeps a one-pixel
    margin, so the border reads as the background."""
    rng = random.Random(seed)
    size = rng.randint(*SIZES)
    dy, dx = DIRECTIONS[spec.direction]
    travel = SPEED * (frames - 1)

    def start(step: int) -> int:  # along one axis: the whole path inside [1, res - 1)
        lo = 1 + (travel if step < 0 else 0)
        hi = res - 1 - size - (travel if step > 0 else 0)
        if hi < lo:
            raise ValueError(f"a {size}px shape moving {travel}px does not fit in {res}px")
        return rng.randint(lo, hi)

    top, left = start(dy), start(dx)
    clip = np.empty((frames, res, res, 3), dtype=np.uint8)
    clip[:] = COLORS[spec.background]
    for k in range(frames):
        clip[k][shape_mask(spec.shape, size, res, top + dy * SPEED * k, left + dx * SPEED * k)] = COLORS[spec.color]
    return clip


def train_prompts() -> list[str]:
    """The registered prompt set ``moving-shapes-train``."""
    return [s.prompt for s in split_specs()[0]]


def heldout_prompts() -> list[str]:
    """The registered prompt set ``moving-shapes-heldout`` (captions never seen in pretraining)."""
    return [s.prompt for s in split_specs()[1]]
