"""The papers' reward table: mean and std of each reward over ODE samples of a prompt set."""

from __future__ import annotations

import math

import torch


def reward_table(sampler, prompts: list[str], metadata: list[dict], seeds: list[int], reward_set, max_batch: int = 64,
                 progress: bool = True, keep_images: int = 0):
    """Score ODE samples of every (prompt, seed) with every reward of ``reward_set``.

    Returns (summary, samples): summary rows {metric, mean, std, n, invalid} (std over images, ddof 1; NaN/inf
    scores are left out and counted), and one row per image {prompt, seed, <metric>...}. Fixed seeds make the
    same prompts give the same numbers. ``keep_images`` > 0: also return the images of the first that many
    prompts (all seeds each), prompt-major, as a third value (for a sample grid)."""
    from tqdm.auto import tqdm

    per_chunk = max(1, max_batch // max(1, len(seeds)))
    columns: dict[str, list[float]] = {}
    samples, kept = [], []
    for start in tqdm(range(0, len(prompts), per_chunk), desc="eval", unit="batch", disable=not progress):
        chunk, meta = prompts[start:start + per_chunk], metadata[start:start + per_chunk]
        images = sampler(chunk, seeds)
        if start < keep_images:
            kept.append(images[:max(0, keep_images - start) * len(seeds)])
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
    if keep_images:
        return summary, samples, torch.cat(kept) if kept else torch.empty(0)
    return summary, samples


def per_prompt_means(samples: list[dict], metrics: list[str]) -> list[dict]:
    """One row per prompt (in order of first appearance): its number of images and each metric's mean over them
    (NaN left out)."""
    rows: dict[str, dict[str, list[float]]] = {}
    for row in samples:
        per = rows.setdefault(row["prompt"], {m: [] for m in metrics})
        for m in metrics:
            if math.isfinite(row[m]):
                per[m].append(row[m])
    counts = {}
    for row in samples:
        counts[row["prompt"]] = counts.get(row["prompt"], 0) + 1
    return [{"prompt": p, "images": counts[p], **{m: (sum(v) / len(v) if v else float("nan")) for m, v in ms.items()}}
            for p, ms in rows.items()]


def group_means(samples: list[dict], prompts: list[str], metadata: list[dict], column: str,
                metrics: list[str]) -> dict:
    """Per value of a metadata column, each metric's mean over that group's images (NaN left out), and ``overall``:
    the mean of the group means, as GenEval aggregates its tasks.

    Args:
        samples: per-image rows ``{prompt, seed, <metric>: score}`` (:func:`reward_table`'s second value).
        prompts, metadata: the evaluated prompts and their metadata (the group comes from ``metadata[i][column]``).
        column: the metadata column.
        metrics: the metric names.
    Returns:
        ``{"by": column, "groups": {value: {metric: mean}}, "overall": {metric: mean of group means}}``.
    """
    group_of = {p: str(m.get(column, "")) for p, m in zip(prompts, metadata)}
    values: dict[str, dict[str, list[float]]] = {}
    for row in samples:
        g = values.setdefault(group_of[row["prompt"]], {m: [] for m in metrics})
        for m in metrics:
            if math.isfinite(row[m]):
                g[m].append(row[m])
    groups = {g: {m: (sum(v) / len(v) if v else float("nan")) for m, v in ms.items()} for g, ms in sorted(values.items())}
    overall = {m: sum(groups[g][m] for g in groups) / len(groups) for m in metrics} if groups else {}
    return {"by": column, "groups": groups, "overall": overall}


def format_table(summary: list[dict]) -> str:
    """The papers' table: one line per metric, mean +- std over images."""
    width = max(len("metric"), *(len(r["metric"]) for r in summary))
    lines = [f"{'metric':<{width}}  {'mean':>10}  {'std':>10}  {'n':>6}  {'invalid':>7}"]
    for r in summary:
        lines.append(f"{r['metric']:<{width}}  {r['mean']:>10.4f}  {r['std']:>10.4f}  {r['n']:>6d}  {r['invalid']:>7d}")
    return "\n".join(lines)
