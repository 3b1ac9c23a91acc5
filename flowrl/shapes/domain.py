"""The "shapes" domain: one coloured shape on a coloured background, rendered deterministically.

Captions read "a red circle on a blue background". 4 shapes x 8 colours x 7 other background colours =
224 prompts; a fixed, seeded subset of them is held out (never seen in pretraining) and every colour and
shape still appears in the training prompts. Images are rendered without anti-aliasing so that the pixel
checker (``flowrl.shapes.reward``) can be exact on ground truth.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 50),
    "blue": (30, 60, 220),
    "yellow": (240, 220, 30),
    "white": (245, 245, 245),
    "black": (15, 15, 15),
    "purple": (140, 40, 180),
    "orange": (245, 140, 20),
}
SHAPES = ["circle", "square", "triangle", "cross"]
NUM_HELDOUT = 24
SPLIT_SEED = 1234


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


@dataclass(frozen=True)
class ShapeSpec:
    shape: str
    color: str
    background: str

    @property
    def prompt(self) -> str:
        return f"{article(self.color)} {self.color} {self.shape} on {article(self.background)} {self.background} background"


def all_specs() -> list[ShapeSpec]:
    return [ShapeSpec(s, c, b) for s in SHAPES for c in COLORS for b in COLORS if b != c]


def split_specs() -> tuple[list[ShapeSpec], list[ShapeSpec]]:
    """(train, held-out): a seeded choice of NUM_HELDOUT prompts, re-drawn until every attribute value
    remains in the training split."""
    specs = all_specs()
    rng = random.Random(SPLIT_SEED)
    while True:
        held = set(rng.sample(range(len(specs)), NUM_HELDOUT))
        train = [s for i, s in enumerate(specs) if i not in held]
        if ({s.shape for s in train} == set(SHAPES) and {s.color for s in train} == set(COLORS)
                and {s.background for s in train} == set(COLORS)):
            return train, [specs[i] for i in sorted(held)]


def parse_prompt(prompt: str) -> ShapeSpec | None:
    """Inverse of ``ShapeSpec.prompt``; None when the prompt is outside the domain's vocabulary."""
    words = prompt.strip().lower().rstrip(".").split()
    if len(words) != 7 or words[0] not in ("a", "an") or words[3] != "on" or words[4] not in ("a", "an") \
            or words[6] != "background":
        return None
    color, shape, background = words[1], words[2], words[5]
    if color not in COLORS or background not in COLORS or shape not in SHAPES or color == background:
        return None
    return ShapeSpec(shape, color, background)


def shape_mask(shape: str, size: int, res: int, top: int, left: int) -> np.ndarray:
    yy, xx = np.mgrid[0:res, 0:res]
    y = yy - top
    x = xx - left
    inside = (y >= 0) & (y < size) & (x >= 0) & (x < size)
    if shape == "square":
        return inside
    if shape == "circle":
        c = (size - 1) / 2
        return inside & ((y - c) ** 2 + (x - c) ** 2 <= (size / 2) ** 2)
    if shape == "triangle":  # apex up, base at the bottom
        c = (size - 1) / 2
        half = (y + 1) / size * size / 2  # half-width grows linearly to size/2 at the base
        return inside & (np.abs(x - c) <= half)
    if shape == "cross":
        third = size / 3
        horiz = (y >= third) & (y < 2 * third)
        vert = (x >= third) & (x < 2 * third)
        return inside & (horiz | vert)
    raise ValueError(f"unknown shape {shape!r}")


def render(spec: ShapeSpec, res: int = 32, seed: int = 0) -> np.ndarray:
    """uint8 image (res, res, 3). Size and position are drawn from ``seed``."""
    rng = random.Random(seed)
    size = rng.randint(int(res * 0.4), int(res * 0.7))
    top = rng.randint(1, res - size - 1)
    left = rng.randint(1, res - size - 1)
    img = np.empty((res, res, 3), dtype=np.uint8)
    img[:] = COLORS[spec.background]
    img[shape_mask(spec.shape, size, res, top, left)] = COLORS[spec.color]
    return img


def train_prompts() -> list[str]:
    """The registered prompt set ``shapes-train``."""
    return [s.prompt for s in split_specs()[0]]


def heldout_prompts() -> list[str]:
    """The registered prompt set ``shapes-heldout`` (captions never seen in pretraining)."""
    return [s.prompt for s in split_specs()[1]]
