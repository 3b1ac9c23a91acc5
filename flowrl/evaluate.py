"""The papers' reward table: mean and std of each reward over ODE samples of a prompt set."""

from __future__ import annotations

import torch


def reward_table(sampler, prompts: list[str], metadata: list[dict], seeds: list[int], reward_set, max_batch: int = 64,
                 progress: bool = True):
    """Score ODE samples of every (prompt, seed) with every reward of ``reward_set``.

    Returns (summary, samples): summary rows {metric, mean, std, n, invalid} (std over images, ddof 1; NaN/inf
    scores are left out and counted), and one row per image {prompt, seed, <metric>...}. Fixed seeds make the
    same prompts give the same numbers."""
    from tqdm.auto import tqdm

    per_chunk = max(1, max_batch // max(1, len(seeds)))
    columns: dict[str, list[float]] = {}
    samples = []
    for start in tqdm(range(0, len(prompts), per_chunk), desc="eval", unit="batch", disable=not progress):
        chunk, meta = prompts[start:start + per_chunk], metadata[start:start + per_chunk]
        images = sampler(chunk, seeds)
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
