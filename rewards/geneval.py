"""GenEval's compositional rules: whether an image's detected objects satisfy a prompt's metadata.

GenEval prompts come with metadata (its ``evaluation_metadata.jsonl`` layout)::

    {"tag": "position", "prompt": "a photo of a dog left of a cat",
     "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1, "position": ["left of", 0]}]}

``include`` clauses must all hold: at least ``count`` objects of the class, the ``count`` most confident of them
of the asked ``color``, and each of them in the asked relation to every object matched by the clause it names;
any ``exclude`` clause fails the image when ``count`` or more of its class are detected. The six tasks
(``single_object``, ``two_object``, ``counting``, ``colors``, ``position``, ``color_attr``) are combinations of these.

Detections are kept above a confidence threshold (0.3; 0.9 for counting prompts), most confident first, at most 16
per class. Position compares box centres after shrinking the offset by 0.1 of the two boxes' summed sizes per
axis: A is "left of" B when the shrunk offset points more than 60 degrees from vertical to the left
(dx < -0.5 of the unshrunk offset's length), and likewise for right of, above and below.

These are pure functions of the detections, tested by hand. :class:`GenEvalReward` runs them on an
open-vocabulary detector from transformers and a CLIP colour classifier.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

THRESHOLD, COUNTING_THRESHOLD, MAX_OBJECTS, POSITION_THRESHOLD = 0.3, 0.9, 16, 0.1
COLORS = ["red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white"]
TASKS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")


@dataclass
class Detection:
    box: tuple[float, float, float, float]  # x0, y0, x1, y1 in pixels (y grows downwards)
    score: float
    label: str


def keep_detections(detections: list[Detection], tag: str, threshold: float = THRESHOLD,
                    counting_threshold: float = COUNTING_THRESHOLD,
                    max_objects: int = MAX_OBJECTS) -> dict[str, list[Detection]]:
    """Per class, the detections above the task's threshold, most confident first, at most ``max_objects``."""
    limit = counting_threshold if tag == "counting" else threshold
    kept: dict[str, list[Detection]] = {}
    for det in sorted(detections, key=lambda d: -d.score):
        if det.score > limit and len(kept.setdefault(det.label, [])) < max_objects:
            kept[det.label].append(det)
    return {k: v for k, v in kept.items() if v}


def relative_position(box_a, box_b, threshold: float = POSITION_THRESHOLD) -> set[str]:
    """Where box A lies relative to box B: a subset of {"left of", "right of", "above", "below"}."""
    a, b = np.asarray(box_a, dtype=float).reshape(2, 2), np.asarray(box_b, dtype=float).reshape(2, 2)
    offset = a.mean(axis=0) - b.mean(axis=0)  # centre of A minus centre of B, (dx, dy)
    size = np.abs(a[1] - a[0]) + np.abs(b[1] - b[0])
    shrunk = np.maximum(np.abs(offset) - threshold * size, 0) * np.sign(offset)
    if np.all(np.abs(shrunk) < 1e-3):
        return set()
    dx, dy = shrunk / np.linalg.norm(offset)
    relations = set()
    if dx < -0.5:
        relations.add("left of")
    if dx > 0.5:
        relations.add("right of")
    if dy < -0.5:
        relations.add("above")
    if dy > 0.5:
        relations.add("below")
    return relations


def check(objects: dict[str, list[Detection]], metadata: dict,
          colors_of: Callable[[str, list[Detection]], list[str]] | None = None) -> tuple[bool, list[str], float]:
    """GenEval's verdict on one image.

    Args:
        objects: the kept detections per class (:func:`keep_detections`).
        metadata: the prompt's ``include`` / ``exclude`` clauses.
        colors_of: ``(class, detections) -> one colour name per detection``; needed by clauses with a colour.
    Returns:
        ``(correct, reasons, partial)``: all clauses hold; what failed; the fraction of clauses that hold.
    """
    reasons: list[str] = []
    matched: list[list[Detection] | None] = []
    clauses = held = 0
    for req in metadata.get("include", []):
        clauses += 1
        name, count = req["class"], req["count"]
        found = objects.get(name, [])[:count]
        ok = len(found) >= count
        if not ok:
            reasons.append(f"expected {name}>={count}, found {len(found)}")
        if ok and "color" in req:
            if colors_of is None:
                raise ValueError("a colour clause needs colors_of")
            colors = colors_of(name, found)
            if colors.count(req["color"]) < count:
                ok = False
                reasons.append(f"expected {req['color']} {name}>={count}, found {colors.count(req['color'])}")
        if ok and "position" in req:
            relation, target = req["position"]
            targets = matched[target] if target < len(matched) else None
            if targets is None:
                ok = False
                reasons.append(f"no target for {name} to be {relation}")
            elif not all(relation in relative_position(o.box, t.box) for o in found for t in targets):
                ok = False
                reasons.append(f"expected {name} {relation} the target")
        matched.append(found if ok else None)
        held += ok
    for req in metadata.get("exclude", []):
        clauses += 1
        n = len(objects.get(req["class"], []))
        if n >= req["count"]:
            reasons.append(f"expected {req['class']}<{req['count']}, found {n}")
        else:
            held += 1
    return not reasons, reasons, (held / clauses if clauses else math.nan)


def classes_of(metadata: dict) -> list[str]:
    """The object classes a prompt's clauses name (the detector's text queries)."""
    names = [r["class"] for r in metadata.get("include", []) + metadata.get("exclude", [])]
    return list(dict.fromkeys(names))
