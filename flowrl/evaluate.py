"""Held-out evaluation on the shapes domain: strict per-attribute accuracy from pixels."""

from __future__ import annotations

import torch

from .prompts import prompt_set


@torch.no_grad()
def shapes_accuracy(adapter, sigmas: torch.Tensor, seeds: list[int], guidance_scale: float, negative=None,
                    split: str = "shapes-heldout", max_batch: int = 64, return_images: bool = False):
    """Sample every prompt of ``split`` at every seed (ODE) and read background, colour and shape back.
    With ``return_images`` also returns the samples, (P * S, 3, H, W) prompt-major."""
    from .rewards.shapes import attribute_scores
    from .trainer import sample_images

    prompts = prompt_set(split)
    shape = adapter.latent_shape(adapter.transformer.config.sample_size)
    images = sample_images(adapter, prompts, seeds, sigmas, shape, guidance_scale, negative, max_batch)
    s = attribute_scores(images, [p for p in prompts for _ in seeds])
    both = s["bg_ok"] * s["color_ok"] * s["shape_ok"]
    result = {"split": split, "images": len(both), "background": round(float(s["bg_ok"].mean()), 4),
            "color": round(float(s["color_ok"].mean()), 4), "shape": round(float(s["shape_ok"].mean()), 4),
            "all": round(float(both.mean()), 4),
            "reward": round(float(((s["bg_score"] + s["color_score"] + s["shape_score"]) / 3).mean()), 4)}
    return (result, images) if return_images else result
