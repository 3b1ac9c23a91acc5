"""Reward registry: name -> factory, weighted sums, and user rewards given as ``module:function``."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flowrl.errors import FlowRLError, RewardError
from flowrl.registry import Registry

# rewards[].name: a factory (class or function) returning a scorer, imported on first use; installed packages add
# theirs under the entry-point group "flowrl_rewards"
REWARDS = Registry("reward", {
    "ocr": "flowrl.rewards.ocr:OCRReward",
    "hpsv3": "flowrl.rewards.hpsv3:HPSv3",
    "imagereward": "flowrl.rewards.imagereward:ImageReward",
    "geneval": "flowrl.rewards.geneval:GenEvalReward",
    "pickscore": "flowrl.rewards.pickscore:PickScore",
    "hpsv2": "flowrl.rewards.hpsv2:HPSv2",
    "remote": "flowrl.rewards.remote:RemoteReward",
    "jpeg_compressibility": "flowrl.rewards.jpeg:JpegCompressibility",
    "jpeg_incompressibility": "flowrl.rewards.jpeg:JpegIncompressibility",
    "aesthetic": "flowrl.rewards.aesthetic:AestheticReward",
    "video_frames": "flowrl.rewards.video:VideoFrames",
    "temporal_consistency": "flowrl.rewards.video:TemporalConsistency",
    "videoalign": "flowrl.rewards.videoalign:VideoAlign",
    "clip": "flowrl.rewards.clip:ClipScore",
    "vlm_judge": "flowrl.rewards.vlm_judge:VLMJudge",
    "preservation": "flowrl.rewards.preservation:Preservation",
    "edit_gate": "flowrl.rewards.preservation:EditGate",
    "editreward": "flowrl.rewards.editreward:EditReward",
    # the shapes demo's, outside this package
    "shapes": "flowrl.shapes.reward:ShapesReward", "shapes_accuracy": "flowrl.shapes.reward:ShapesAccuracy",
    "shapes_edit": "flowrl.shapes.editing:ShapesEditReward",
    "shapes_edit_accuracy": "flowrl.shapes.editing:ShapesEditAccuracy",
    "moving_shapes": "flowrl.shapes.video_reward:MovingShapesReward",
    "moving_shapes_accuracy": "flowrl.shapes.video_reward:MovingShapesAccuracy",
}, group="flowrl_rewards", error=RewardError, kind=(callable, "a reward: a scorer function, or a class that builds one"))


def register_reward(name: str):
    """Decorator: ``@register_reward("my_reward")`` on a factory (class or function returning a scorer)."""
    return REWARDS.register(name)


def build_reward(name: str, **args) -> Callable:
    """A scorer by registered name, or ``module:function`` (called directly, or as a factory if it is a class).

    A scorer is called as ``scorer(images, prompts, metadata)`` with images (N, 3, H, W) in [0, 1] (videos
    (N, F, 3, H, W)), N prompts and N metadata dicts, and returns (N,) scores; NaN marks an image it could not
    score.

    Args:
        name: a registered reward (``pickscore``, ``clip``, ...) or ``module:attribute``.
        **args: the reward's constructor arguments (a config's ``rewards[i].args``).
    Returns:
        The scorer.
    """
    obj = REWARDS.resolve(name)
    if ":" in name:  # a user's scorer is called as it is; a class is built with the arguments
        return obj(**args) if inspect.isclass(obj) else obj
    try:
        return obj(**args)
    except TypeError as exc:
        raise RewardError(f"reward {name!r}: bad arguments {args} ({exc})") from exc


def check_score_range(name: str, score_range) -> None:
    """A reward's declared ``score_range`` is None or (low, high): two numbers (not NaN) with low <= high."""
    if score_range is None:
        return
    try:
        low, high = (float(v) for v in score_range)
    except (TypeError, ValueError):
        raise RewardError(f"reward {name!r}: score_range {score_range!r} must be (low, high), two numbers") from None
    if math.isnan(low) or math.isnan(high) or low > high:
        raise RewardError(f"reward {name!r}: score_range {score_range!r} must be (low, high) with low <= high")


@dataclass
class RewardScores:
    total: torch.Tensor  # (N,) weighted sum, NaN where any component was not finite
    components: dict[str, torch.Tensor]  # name -> (N,) raw scores
    invalid: torch.Tensor  # (N,) bool: a component returned NaN/inf
    features: torch.Tensor | None = None  # (N, D) image embeddings, where the reward set embeds its images

    @classmethod
    def concat(cls, parts: list[RewardScores]) -> RewardScores:
        if len(parts) == 1:
            return parts[0]
        features = torch.cat([p.features for p in parts]) if parts[0].features is not None else None
        return cls(torch.cat([p.total for p in parts]),
                   {k: torch.cat([p.components[k] for p in parts]) for k in parts[0].components},
                   torch.cat([p.invalid for p in parts]), features)

    def summary(self) -> dict[str, float]:
        """reward_mean/<name> and reward_std/<name> over the finite scores, for the total and every component."""
        out = {}
        for name, values in [("total", self.total)] + list(self.components.items()):
            ok = values[torch.isfinite(values)]
            out[f"reward_mean/{name}"] = float(ok.mean()) if ok.numel() else float("nan")
            out[f"reward_std/{name}"] = float(ok.std(correction=0)) if ok.numel() else float("nan")
        return out


class RewardSet:
    """A weighted sum of rewards; every component is kept for logging."""

    def __init__(self, items: list[tuple[str, float, Callable]]):
        if not items:
            raise RewardError("no rewards configured")
        for name, _, fn in items:
            check_score_range(name, getattr(fn, "score_range", None))
        self.items = items
        self.embedder: Callable | None = None  # images -> (N, D) features, returned with the scores when set

    def embed_images_with(self, embedder: Callable) -> None:
        """Also return each image's feature vector (``RewardScores.features``), computed where the images are
        scored (an :class:`~rewards.embedding.ImageEmbedder`, or any images -> (N, D) callable)."""
        self.embedder = embedder

    @property
    def names(self) -> list[str]:
        return [n for n, _, _ in self.items]

    @property
    def weights(self) -> dict[str, float]:
        return {n: w for n, w, _ in self.items}

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> RewardScores:
        n = images.shape[0]
        metadata = metadata if metadata is not None else [{} for _ in range(n)]
        total = torch.zeros(n, dtype=torch.float64)
        invalid = torch.zeros(n, dtype=torch.bool)
        components = {}
        for name, weight, fn in self.items:
            try:
                raw = fn(images, prompts, metadata)
            except RewardError:
                raise
            except Exception as exc:  # a user's scorer: name it, keep its message, no traceback
                if images.ndim == 5 and not getattr(fn, "accepts_video", False):
                    raise RewardError(f"reward {name!r} scores images (N, 3, H, W) but this model makes videos "
                                      f"(N, F, 3, H, W); score its frames with rewards=[{{name: video_frames, args: "
                                      f"{{reward: {name}}}}}]") from exc
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                raise RewardError(f"reward {name!r} failed: {type(exc).__name__}: {first}"[:500]) from exc
            try:
                scores = torch.as_tensor(raw, dtype=torch.float64).detach().cpu()
            except (TypeError, ValueError, RuntimeError) as exc:
                raise RewardError(f"reward {name!r} returned {type(raw).__name__} {str(raw)[:40]!r}; it must return "
                                  f"one number per image (a tensor, array or list of {n})") from exc
            if scores.shape != (n,):
                raise RewardError(f"reward {name!r} returned shape {tuple(scores.shape)}; it must return one score "
                                  f"per image, shape ({n},)")
            bad = ~torch.isfinite(scores)
            low, high = getattr(fn, "score_range", None) or (-math.inf, math.inf)
            bad |= (scores < low) | (scores > high)  # outside what the reward can give: masked and counted
            invalid |= bad
            components[name] = torch.where(bad, torch.full_like(scores, math.nan), scores)  # masked in every report
            total += weight * torch.where(bad, torch.zeros_like(scores), scores)
        total[invalid] = math.nan
        features = None
        if self.embedder is not None:
            features = torch.as_tensor(self.embedder(images)).detach().float().cpu()
            if features.ndim != 2 or features.shape[0] != n:
                raise RewardError(f"the image embedder returned shape {tuple(features.shape)}; it must return one "
                                  f"vector per image, shape ({n}, D)")
        return RewardScores(total.float(), {k: v.float() for k, v in components.items()}, invalid, features)

    def check_metadata(self, prompts: list[str], metadata: list[dict], where: str = "data") -> None:
        """Every prompt's metadata as each reward that reads it requires (a reward's ``metadata_problem(meta)``:
        None, or why not), checked when the prompts load; one line naming the first prompt that fails."""
        for name, _, fn in self.items:
            check = getattr(fn, "metadata_problem", None)
            if not callable(check):
                continue
            for k, (prompt, meta) in enumerate(zip(prompts, metadata)):
                problem = check(meta)
                if problem:
                    raise RewardError(f"{where}: prompt {k} ({prompt[:60]!r}) has metadata the {name} reward cannot "
                                      f"use: {problem}")

    def not_differentiable(self) -> list[str]:
        """The names of the rewards that cannot pass a gradient back to the images (empty: all can)."""
        return [name for name, _, fn in self.items if differentiable_scorer(fn) is None]

    def differentiable_total(self, images: torch.Tensor, prompts: list[str],
                             metadata: list[dict] | None = None) -> torch.Tensor:
        """The weighted sum (N,) with its graph back to ``images`` (N, 3, H, W) (or videos), for methods that
        follow the reward's gradient (reward backpropagation, guided sampling)."""
        bad = self.not_differentiable()
        if bad:
            raise RewardError(f"rewards {bad} pass no gradient to the images; use differentiable rewards (clip, or "
                              f"a function marked differentiable = True)")
        metadata = metadata if metadata is not None else [{} for _ in range(images.shape[0])]
        total = 0.0
        for _, weight, fn in self.items:
            total = total + weight * differentiable_scorer(fn)(images, prompts, metadata).float()
        return total


def differentiable_scorer(scorer) -> Callable | None:
    """The scorer's gradient-carrying form, or None: a scorer with a ``score_with_grad(images, prompts, metadata)``
    method (the built-in CLIP reward), or a callable marked ``differentiable = True`` (a user's function that keeps
    the graph from the images to its scores)."""
    if callable(getattr(scorer, "score_with_grad", None)):
        return scorer.score_with_grad
    return scorer if getattr(scorer, "differentiable", False) else None


def build_reward_set(specs) -> RewardSet:
    """From config ``RewardSpec`` items (name, weight, args)."""
    items = []
    for spec in specs:
        label = spec.name if ":" not in spec.name else spec.name.split(":")[-1]
        taken = {n for n, _, _ in items}
        if label in taken:  # the same reward twice (e.g. two CLIP conventions): clip, clip_2, ...
            label = next(f"{label}_{k}" for k in range(2, len(items) + 3) if f"{label}_{k}" not in taken)
        try:
            scorer = build_reward(spec.name, **dict(spec.args))
        except FlowRLError:  # already one line that names the reward and what to change
            raise
        except Exception as exc:  # a user's factory that raises while building
            raise RewardError(f"reward {spec.name!r}: building it failed: {type(exc).__name__}: "
                              f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:500]) from exc
        items.append((label, float(spec.weight), scorer))
    return RewardSet(items)
