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


def reward_table(adapter, prompts: list[str], metadata: list[dict], seeds: list[int], sigmas: torch.Tensor,
                 reward_set, guidance_scale: float, negative=None, max_batch: int = 64, progress: bool = True):
    """Score ODE samples of every (prompt, seed) with every reward of ``reward_set``.

    Returns (summary, samples): summary rows {metric, mean, std, n, invalid} (std over images, ddof 1; NaN/inf
    scores are left out and counted), and one row per image {prompt, seed, <metric>...}. Fixed seeds make the
    same prompts give the same numbers."""
    from tqdm.auto import tqdm

    from .trainer import sample_images

    shape = adapter.latent_shape(adapter.transformer.config.sample_size)
    per_chunk = max(1, max_batch // max(1, len(seeds)))
    columns: dict[str, list[float]] = {}
    samples = []
    for start in tqdm(range(0, len(prompts), per_chunk), desc="eval", unit="batch", disable=not progress):
        chunk, meta = prompts[start:start + per_chunk], metadata[start:start + per_chunk]
        images = sample_images(adapter, chunk, seeds, sigmas, shape, guidance_scale, negative, max_batch)
        scores = reward_set(images, [p for p in chunk for _ in seeds], [m for m in meta for _ in seeds])
        named = dict(scores.components)
        if len(named) > 1:
            named["total"] = scores.total
        for k, (p, s) in enumerate((p, s) for p in chunk for s in seeds):
            samples.append({"prompt": p, "seed": s, **{m: float(v[k]) for m, v in named.items()}})
        for m, v in named.items():
            columns.setdefault(m, []).extend(v.double().tolist())
    summary = []
    for m, values in columns.items():
        v = torch.tensor(values, dtype=torch.float64)
        ok = v[torch.isfinite(v)]
        summary.append({"metric": m, "mean": float(ok.mean()) if ok.numel() else float("nan"),
                        "std": float(ok.std()) if ok.numel() > 1 else 0.0, "n": int(ok.numel()),
                        "invalid": int(v.numel() - ok.numel())})
    return summary, samples


def format_table(summary: list[dict]) -> str:
    """The papers' table: one line per metric, mean +- std over images."""
    width = max(len("metric"), *(len(r["metric"]) for r in summary))
    lines = [f"{'metric':<{width}}  {'mean':>10}  {'std':>10}  {'n':>6}  {'invalid':>7}"]
    for r in summary:
        lines.append(f"{r['metric']:<{width}}  {r['mean']:>10.4f}  {r['std']:>10.4f}  {r['n']:>6d}  {r['invalid']:>7d}")
    return "\n".join(lines)
