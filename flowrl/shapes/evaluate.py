"""Held-out evaluation on the shapes domain: strict per-attribute accuracy read back from pixels."""

from __future__ import annotations

import torch

from . import moving
from . import video_reward
from .domain import SHAPES, heldout_prompts, parse_prompt, train_prompts
from .reward import attribute_scores

SPLITS = {"shapes-heldout": heldout_prompts, "shapes-train": train_prompts}


@torch.no_grad()
def shapes_accuracy(sampler, seeds: list[int], split: str = "shapes-heldout", return_images: bool = False):
    """Sample every prompt of ``split`` at every seed (``sampler(prompts, seeds)``, ODE) and read background,
    colour and shape back. With ``return_images`` also returns the samples, (P * S, 3, H, W) prompt-major."""
    prompts = SPLITS[split]()
    images = sampler(prompts, seeds)
    s = attribute_scores(images, [p for p in prompts for _ in seeds])
    both = s["bg_ok"] * s["color_ok"] * s["shape_ok"]
    shapes = [parse_prompt(p).shape for p in prompts for _ in seeds]
    result = {"split": split, "images": len(both), "background": round(float(s["bg_ok"].mean()), 4),
              "color": round(float(s["color_ok"].mean()), 4), "shape": round(float(s["shape_ok"].mean()), 4),
              "all": round(float(both.mean()), 4),
              "reward": round(float(((s["bg_score"] + s["color_score"] + s["shape_score"]) / 3).mean()), 4),
              "background_noise": round(float(s["bg_noise"].mean()), 3),  # cleanliness (lower is cleaner)
              # all-three accuracy per asked shape: where the model is weak, and what training fixes
              "per_shape": {k: round(float(both[[sh == k for sh in shapes]].mean()), 4) for k in SHAPES
                            if k in shapes}}
    return (result, images) if return_images else result


class ShapesEvaluator:
    """``log.eval: shapes``. ``evaluator(sampler, seeds)`` -> the held-out accuracy; with ``grid=True`` also
    the samples of ``GRID_PROMPTS`` held-out prompts spread over the shapes (first ``GRID_COLUMNS`` seeds) and
    their labels, for the before | after grid."""

    GRID_PROMPTS = 6
    GRID_COLUMNS = 4
    headline = "all"  # the number the held-out curve maximises unless log.best_metric names another
    # how reports show it (reward_curve.png's held-out panel, `flowrl rank`): in %, and the number that must not
    # rise while it does (background texture the checker ignores: reward hacking in miniature)
    about = {"title": "held-out accuracy, all three (ODE)", "scale": 100.0, "unit": "%", "watch": "background_noise"}
    # (key, label, format) of the numbers the before | after grid's title compares
    title_numbers = (("all", "all-correct", ".2f"),
                     ("background_noise", "background noise", ".1f"))  # texture the checker ignores

    splits = {"heldout": "shapes-heldout", "train": "shapes-train"}  # `flowrl eval --split`: prompt-set names
    # what a subclass measures: measure(sampler, seeds, split=..., return_images=...), and its held-out prompts
    measure = staticmethod(shapes_accuracy)
    heldout = staticmethod(heldout_prompts)

    def __call__(self, sampler, seeds: list[int], grid: bool = False, split: str = "heldout"):
        if not grid:
            return self.measure(sampler, seeds, split=self.splits.get(split, split))
        result, images = self.measure(sampler, seeds, return_images=True)
        held = self.heldout()
        picks = list(range(0, len(held), max(1, len(held) // self.GRID_PROMPTS)))[: self.GRID_PROMPTS]
        cols = min(self.GRID_COLUMNS, len(seeds))
        chosen = torch.cat([images[i * len(seeds): i * len(seeds) + cols] for i in picks])
        return result, chosen, [held[i] for i in picks]


MOVING_SPLITS = {"moving-shapes-heldout": moving.heldout_prompts, "moving-shapes-train": moving.train_prompts}


@torch.no_grad()
def moving_shapes_accuracy(sampler, seeds: list[int], split: str = "moving-shapes-heldout", return_images: bool = False):
    """Sample every caption of ``split`` at every seed (ODE) and read background, colour, shape and motion
    direction back from the frames. With ``return_images`` also returns the clips, (P * S, F, 3, H, W)."""
    prompts = MOVING_SPLITS[split]()
    videos = sampler(prompts, seeds)
    s = video_reward.attribute_scores(videos, [p for p in prompts for _ in seeds])
    every = s["bg_ok"] * s["color_ok"] * s["shape_ok"] * s["motion_ok"]
    specs = [moving.parse_prompt(p) for p in prompts for _ in seeds]
    result = {"split": split, "videos": len(every), "background": round(float(s["bg_ok"].mean()), 4),
              "color": round(float(s["color_ok"].mean()), 4), "shape": round(float(s["shape_ok"].mean()), 4),
              "motion": round(float(s["motion_ok"].mean()), 4), "all": round(float(every.mean()), 4),
              "reward": round(float(((s["bg_score"] + s["color_score"] + (1 + s["shape_margin"]) / 2
                                      + s["motion_score"]) / 4).mean()), 4),
              "background_noise": round(float(s["bg_noise"].mean()), 3),
              "per_shape": {k: round(float(every[[sp.shape == k for sp in specs]].mean()), 4) for k in SHAPES
                            if any(sp.shape == k for sp in specs)},
              "per_direction": {d: round(float(every[[sp.direction == d for sp in specs]].mean()), 4)
                                for d in moving.DIRECTIONS if any(sp.direction == d for sp in specs)}}
    return (result, videos) if return_images else result


class MovingShapesEvaluator(ShapesEvaluator):
    """``log.eval: moving-shapes``: held-out accuracy of the video model (background, colour, shape, motion, all
    four), and with ``grid=True`` the clips of a few held-out captions for the before | after grid."""

    about = {**ShapesEvaluator.about, "title": "held-out accuracy, all four (ODE)"}
    splits = {"heldout": "moving-shapes-heldout", "train": "moving-shapes-train"}
    measure = staticmethod(moving_shapes_accuracy)
    heldout = staticmethod(moving.heldout_prompts)
