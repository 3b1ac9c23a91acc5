"""Held-out evaluation on the shapes domain: strict per-attribute accuracy read back from pixels."""

from __future__ import annotations

import torch

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

    def __call__(self, sampler, seeds: list[int], grid: bool = False):
        if not grid:
            return shapes_accuracy(sampler, seeds)
        result, images = shapes_accuracy(sampler, seeds, return_images=True)
        held = heldout_prompts()
        picks = list(range(0, len(held), max(1, len(held) // self.GRID_PROMPTS)))[: self.GRID_PROMPTS]
        cols = min(self.GRID_COLUMNS, len(seeds))
        chosen = torch.cat([images[i * len(seeds): i * len(seeds) + cols] for i in picks])
        return result, chosen, [held[i] for i in picks]
