"""Editing on the shapes domain: a source image (one coloured shape on a coloured background) and an instruction that
changes one attribute ("make the shape red", "make the background blue", "turn the circle into a square").

- Source keys ``shapes:<caption>#<seed>`` render the caption with the domain's renderer at the model's resolution
  (the seed draws the shape's size and position), so edit requests need no image files.
- ``shapes-edit-train`` / ``shapes-edit-heldout``: edit requests on the training / held-out captions' sources.
- ``shapes_edit`` reward: the result read from pixels against the edit's target (the source with the asked attribute
  changed); ``shapes_edit_accuracy``: the asked attribute right and the two others kept, strictly.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from ..editing import EditPrompt, sources_of
from ..errors import RewardError
from .domain import COLORS, SHAPES, ShapeSpec, article, parse_prompt, render, split_specs
from .evaluate import ShapesEvaluator
from .reward import ShapesAccuracy, ShapesReward

EDIT_SEED = 4321
ATTRIBUTES = ("color", "background", "shape")


def render_source(spec: str, size: int):
    """The ``shapes:`` source scheme: ``<caption>#<seed>`` rendered at ``size`` pixels, an RGB PIL image."""
    from PIL import Image

    caption, _, seed = spec.rpartition("#")
    parsed = parse_prompt(caption)
    if parsed is None or not seed.isdigit():
        raise RewardError(f"source shapes:{spec}: expected 'shapes:<a shapes caption>#<seed>'")
    return Image.fromarray(render(parsed, res=size, seed=int(seed)))


def instruction(attribute: str, source: ShapeSpec, value: str) -> str:
    if attribute == "color":
        return f"make the shape {value}"
    if attribute == "background":
        return f"make the background {value}"
    return f"turn the {source.shape} into {article(value)} {value}"


def target_of(source: ShapeSpec, text: str) -> tuple[str, ShapeSpec]:
    """(the asked attribute, the target spec) of an instruction on ``source``."""
    words = text.split()
    if text.startswith("make the shape ") and len(words) == 4 and words[3] in COLORS:
        return "color", ShapeSpec(source.shape, words[3], source.background)
    if text.startswith("make the background ") and len(words) == 4 and words[3] in COLORS:
        return "background", ShapeSpec(source.shape, source.color, words[3])
    if text.startswith("turn the ") and len(words) == 6 and words[5] in SHAPES:
        return "shape", ShapeSpec(words[5], source.color, source.background)
    raise RewardError(f"not a shapes edit instruction: {text!r}")


def edit_requests(specs: list[ShapeSpec], per_source: int, seed: int) -> list[EditPrompt]:
    """``per_source`` edits of each spec's source (distinct attributes, seeded values that keep colour and background
    apart), the source rendered at a seeded size and position."""
    rng = random.Random(seed)
    out = []
    for spec in specs:
        render_seed = rng.randrange(10_000)
        key = f"shapes:{spec.prompt}#{render_seed}"
        for attribute in rng.sample(ATTRIBUTES, per_source):
            value, _ = changed(spec, attribute, rng)
            out.append(EditPrompt(instruction(attribute, spec, value), [key]))
    return out


def changed(spec: ShapeSpec, attribute: str, rng: random.Random) -> tuple[str, ShapeSpec]:
    """(value, spec): ``spec`` with ``attribute`` changed to a seeded value that keeps the shape's colour and the
    background apart (one draw from ``rng``)."""
    if attribute == "shape":
        value = rng.choice([s for s in SHAPES if s != spec.shape])
        return value, ShapeSpec(value, spec.color, spec.background)
    value = rng.choice([c for c in COLORS if c not in (spec.color, spec.background)])
    return value, (ShapeSpec(spec.shape, value, spec.background) if attribute == "color" else
                   ShapeSpec(spec.shape, spec.color, value))


def train_edit_prompts() -> list[EditPrompt]:
    """The registered prompt set ``shapes-edit-train``: two edits of each training caption's source."""
    return edit_requests(split_specs()[0], 2, EDIT_SEED)


def heldout_edit_prompts() -> list[EditPrompt]:
    """The registered prompt set ``shapes-edit-heldout``: every attribute edited on each held-out caption's source."""
    return edit_requests(split_specs()[1], 3, EDIT_SEED + 1)


def source_and_target(prompt: str) -> tuple[ShapeSpec, str, ShapeSpec]:
    keys = sources_of(prompt)
    if not keys or not keys[0].startswith("shapes:"):
        raise RewardError(f"shapes_edit scores edits of shapes sources; prompt {str(prompt)!r} has none")
    source = parse_prompt(keys[0][len("shapes:"):].rpartition("#")[0])
    attribute, target = target_of(source, str(prompt))
    return source, attribute, target


class ShapesEditReward:
    """The shapes reward of the result against the edit's target caption (the source with the asked attribute
    changed), in [0, 1].

    ``part="all"``: the mean of the three attribute scores, so the asked attribute changed and the others kept earn
    the same partial credit as generating the target (see ``shapes``). ``part="asked"``: the asked attribute's score
    alone, an instruction-following reward that does not look at the rest of the image. ``part="kept"``: the mean of
    the two other attributes' scores, which read as the source's: how much of the source the edit preserved.

    ``read=True``: each attribute scores 1 where the checker reads it as the target's and 0 otherwise (the readout
    the edit accuracy counts) instead of the continuous scores, which move little between a shape read right and
    one read wrong."""

    PARTS = ("all", "asked", "kept")

    def __init__(self, shape: str = "margin", part: str = "all", read: bool = False):
        if part not in self.PARTS:
            raise RewardError(f"shapes_edit reward: part={part!r} must be one of {', '.join(self.PARTS)}")
        self.inner = ShapesReward(shape=shape)
        self.part, self.read = part, bool(read)

    def __call__(self, images, prompts, metadata=None):
        from .reward import attribute_scores

        targets = [source_and_target(p) for p in prompts]
        if self.part == "all" and not self.read:
            return self.inner(images, [t[2].prompt for t in targets], metadata)
        s = attribute_scores(images, [t[2].prompt for t in targets])
        if self.read:
            per_attribute = {"background": s["bg_ok"], "color": s["color_ok"], "shape": s["shape_ok"]}  # 0 / 1
        else:
            shape = s["shape_score"] if self.inner.shape == "iou" else (1 + s["shape_margin"]) / 2
            per_attribute = {"background": s["bg_score"], "color": s["color_score"], "shape": shape}  # each (N,)
        if self.part == "all":
            return sum(per_attribute.values()) / 3
        rows = np.arange(len(prompts))
        asked = np.array([per_attribute[attribute][i] for i, (_, attribute, _) in zip(rows, targets)])
        if self.part == "asked":
            return asked
        total = sum(per_attribute.values())
        return (total - asked) / 2


class ShapesEditAccuracy:
    """1 where the result reads as the target exactly (asked attribute right, the two others kept), else 0."""

    def __call__(self, images, prompts, metadata=None):
        return ShapesAccuracy()(images, [source_and_target(p)[2].prompt for p in prompts], metadata)


def edit_outcomes(images: torch.Tensor, prompts: list[str]) -> dict[str, np.ndarray]:
    """Per image: ``asked`` (the asked attribute reads as its target), ``kept`` (both other attributes read as the
    source's) and ``edit`` (both)."""
    from .reward import classify

    asked, kept = [], []
    for (background, color, shape), p in zip(classify(images), prompts):
        source, attribute, target = source_and_target(p)
        read = {"background": background, "color": color, "shape": shape}
        asked.append(read[attribute] == getattr(target, attribute))
        kept.append(all(read[a] == getattr(source, a) for a in ATTRIBUTES if a != attribute))
    asked, kept = np.array(asked), np.array(kept)
    return {"asked": asked, "kept": kept, "edit": asked & kept}


EDIT_SPLITS = {"shapes-edit-heldout": heldout_edit_prompts, "shapes-edit-train": train_edit_prompts}


@torch.no_grad()
def edit_accuracy(sampler, seeds: list[int], split: str = "shapes-edit-heldout", return_images: bool = False):
    """Edit every request of ``split`` at every seed (ODE) and read the results back: ``edit`` (the asked attribute
    right and the two others kept), ``asked``, ``kept``, and the edit accuracy per asked attribute."""
    prompts = EDIT_SPLITS[split]()
    images = sampler(prompts, seeds)
    rows = [p for p in prompts for _ in seeds]
    o = edit_outcomes(images, rows)
    attributes = [source_and_target(p)[1] for p in rows]
    result = {"split": split, "images": len(rows), "edit": round(float(o["edit"].mean()), 4),
              "asked": round(float(o["asked"].mean()), 4), "kept": round(float(o["kept"].mean()), 4),
              "reward": round(float(np.mean(ShapesEditReward()(images, rows))), 4),
              "per_attribute": {a: round(float(o["edit"][[x == a for x in attributes]].mean()), 4)
                                for a in ATTRIBUTES if a in attributes}}
    return (result, images) if return_images else result


class ShapesEditEvaluator(ShapesEvaluator):
    """``log.eval: shapes-edit``: held-out edit accuracy on the shapes edit requests, and with ``grid=True`` the
    results of a few requests (one per source, every attribute) for the source | before | after grid."""

    headline = "edit"
    about = {"title": "held-out edit accuracy: asked attribute right, the others kept (ODE)", "scale": 100.0,
             "unit": "%"}
    title_numbers = (("edit", "edit accuracy", ".2f"), ("kept", "kept the others", ".2f"))
    splits = {"heldout": "shapes-edit-heldout", "train": "shapes-edit-train"}
    measure = staticmethod(edit_accuracy)
    heldout = staticmethod(heldout_edit_prompts)
