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
import torch


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
    for req in (metadata.get("include") or []):
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
    for req in (metadata.get("exclude") or []):
        clauses += 1
        n = len(objects.get(req["class"], []))
        if n >= req["count"]:
            reasons.append(f"expected {req['class']}<{req['count']}, found {n}")
        else:
            held += 1
    return not reasons, reasons, (held / clauses if clauses else math.nan)


RELATIONS = ("left of", "right of", "above", "below")


def metadata_problem(metadata: dict) -> str | None:
    """Why a prompt's GenEval metadata cannot be checked (None: it can): ``include`` / ``exclude`` lists of clauses,
    each with a class name and a whole ``count`` >= 1, an optional colour name, and an include clause's optional
    ``position`` [relation, index of an earlier include clause]."""
    if not isinstance(metadata, dict):
        return f"metadata is {type(metadata).__name__}, not a mapping"
    clauses = {key: metadata.get(key) or [] for key in ("include", "exclude")}
    for key, items in clauses.items():
        if not isinstance(items, list):
            return f"{key} is {type(items).__name__}, not a list of clauses"
        for k, clause in enumerate(items):
            where = f"{key}[{k}]"
            if not isinstance(clause, dict) or not isinstance(clause.get("class"), str) or not clause["class"].strip():
                return f"{where} needs a 'class' name"
            count = clause.get("count")
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                return f"{where} needs a whole 'count' >= 1 (it has {count!r})"
            if "color" in clause and not (isinstance(clause["color"], str) and clause["color"].strip()):
                return f"{where}: 'color' must be a colour name"
            if "position" in clause:
                pos = clause["position"]
                if key == "exclude" or not (isinstance(pos, list) and len(pos) == 2 and pos[0] in RELATIONS
                                            and isinstance(pos[1], int) and not isinstance(pos[1], bool)
                                            and 0 <= pos[1] < len(clauses["include"]) and pos[1] != k):
                    return (f"{where}: 'position' must be [relation, index of another include clause] with a relation "
                            f"in {', '.join(RELATIONS)} (it is {pos!r})")
    return None


def classes_of(metadata: dict) -> list[str]:
    """The object classes a prompt's clauses name (the detector's text queries)."""
    names = [r["class"] for r in (metadata.get("include") or []) + (metadata.get("exclude") or [])]
    return list(dict.fromkeys(names))


class ColorClassifier:
    """GenEval's colour rule: CLIP zero-shot over each detection's crop, the colour names in three templates
    ("a photo of a {c} {class}", "a photo of a {c}-colored {class}", "a photo of a {c} object"), their normalised
    text embeddings averaged per colour.

    Args:
        clip: a :class:`flowrl.rewards.clip.ClipScore` (GenEval's is open_clip ViT-L-14, pretrained openai).
    """

    def __init__(self, clip):
        self.clip = clip
        self._text: dict[str, torch.Tensor] = {}

    def _colour_embeddings(self, name: str):
        if name not in self._text:
            templates = (f"a photo of a {{c}} {name}", f"a photo of a {{c}}-colored {name}", "a photo of a {c} object")
            per_colour = []
            for colour in COLORS:
                e = self.clip.embed_text([t.format(c=colour) for t in templates]).mean(0)
                per_colour.append(e / e.norm())
            self._text[name] = torch.stack(per_colour)  # (10, D)
        return self._text[name]

    def __call__(self, image, name: str, found: list[Detection]) -> list[str]:
        """Args:
            image: (3, H, W) in [0, 1].
            name: the class.
            found: its detections.
        Returns:
            One colour name per detection.
        """
        import torch.nn.functional as F

        h, w = image.shape[-2:]
        crops = []
        for d in found:
            x0, y0, x1, y1 = (int(round(v)) for v in d.box)
            x0, y0 = min(max(x0, 0), w - 1), min(max(y0, 0), h - 1)
            x1, y1 = max(min(x1, w), x0 + 1), max(min(y1, h), y0 + 1)
            crop = image[:, y0:y1, x0:x1]
            crops.append(F.interpolate(crop[None], size=(h, w), mode="bilinear", align_corners=False)[0])
        sims = self.clip.embed_images(torch.stack(crops)) @ self._colour_embeddings(name).T  # (n, 10)
        return [COLORS[i] for i in sims.argmax(1).tolist()]


class GenEvalReward:
    """GenEval's verdict as a reward: an open-vocabulary detector from transformers (OWLv2 / OWL-ViT, by hub id
    or local folder) queried with the classes of each prompt's metadata, the colour rule on CLIP, and
    :func:`check`.

    Args:
        detector: the detector's folder or hub id.
        clip_model, clip_pretrained: the colour classifier (the ``clip`` reward's ``model`` / ``pretrained``;
            default the embedded tiny CLIP, GenEval's own is ViT-L-14 / openai).
        score: ``strict`` (1 when every clause holds, else 0; GenEval's accuracy) or ``partial`` (the fraction
            of clauses that hold).
        device: where the detector and CLIP run.
    """

    def __init__(self, detector: str = "google/owlv2-base-patch16-ensemble", clip_model: str = "tiny-shapes",
                 clip_pretrained: str | None = None, score: str = "strict", device: str = "cpu",
                 threshold: float = THRESHOLD, counting_threshold: float = COUNTING_THRESHOLD):
        from transformers import AutoModelForZeroShotObjectDetection, AutoProcessor

        from flowrl.errors import RewardError

        from .clip import ClipScore

        if score not in ("strict", "partial"):
            raise RewardError(f"geneval reward: score must be strict or partial, not {score!r}")
        from .loading import resolve_pretrained_dir

        detector = resolve_pretrained_dir("geneval reward", detector, "the detector's config, weights and processor")
        try:
            self.processor = AutoProcessor.from_pretrained(detector)
            self.detector = AutoModelForZeroShotObjectDetection.from_pretrained(detector).to(device).eval()
        except OSError as exc:
            raise RewardError(f"geneval reward: cannot load the detector {detector!r} (a local folder, or a hub id "
                              f"where the hub is reachable): {str(exc).splitlines()[0]}") from exc
        self.colors = ColorClassifier(ClipScore(model=clip_model, pretrained=clip_pretrained, device=device))
        self.score, self.device = score, torch.device(device)
        self.threshold, self.counting_threshold = threshold, counting_threshold

    @staticmethod
    def metadata_problem(metadata: dict) -> str | None:
        """Checked for every training and evaluation prompt when the prompts load (:func:`metadata_problem`)."""
        return metadata_problem(metadata)

    def detect(self, image, names: list[str]) -> list[Detection]:
        """Detections of the named classes in one (3, H, W) image in [0, 1]."""
        h, w = image.shape[-2:]
        pixels = (image.detach().float().cpu().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
        inputs = self.processor(text=[[f"a photo of a {n}" for n in names]], images=[pixels], return_tensors="pt")
        with torch.no_grad():
            out = self.detector(**inputs.to(self.device))
        result = self.processor.post_process_grounded_object_detection(
            out, threshold=0.0, target_sizes=torch.tensor([[h, w]]))[0]
        return [Detection(tuple(float(v) for v in box), float(s), names[int(label)])
                for box, s, label in zip(result["boxes"].tolist(), result["scores"].tolist(),
                                         result["labels"].tolist())]

    def __call__(self, images, prompts: list[str], metadata=None):
        """Args:
            images: (N, 3, H, W) in [0, 1].
            prompts: N prompts.
            metadata: N GenEval metadata dicts (``tag``, ``include``, ``exclude``); a prompt without clauses
                is NaN (masked and counted).
        Returns:
            (N,) scores: 1 / 0 (strict) or the fraction of clauses that hold (partial).
        """
        scores = []
        for image, meta in zip(images, metadata or [{}] * len(prompts)):
            names = classes_of(meta or {})
            if not names:
                scores.append(math.nan)
                continue
            objects = keep_detections(self.detect(image, names), meta.get("tag", ""), self.threshold,
                                      self.counting_threshold)
            correct, _, partial = check(objects, meta, lambda n, found, im=image: self.colors(im, n, found))
            scores.append(float(correct) if self.score == "strict" else partial)
        return torch.tensor(scores, dtype=torch.float32)

