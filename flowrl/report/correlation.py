"""Correlations between two (N,) vectors, for comparing scores: the credit estimator's truth against an algorithm's
advantages, a cheap candidate pool's rewards against the real ones."""

from __future__ import annotations

import math

import torch


def average_ranks(x: torch.Tensor) -> torch.Tensor:
    """(N,) ranks 0..N-1 in float64; ties share their mean rank."""
    order = torch.argsort(x, stable=True)
    ranks = torch.empty_like(x, dtype=torch.float64)
    ranks[order] = torch.arange(len(x), dtype=torch.float64)
    for v in torch.unique(x):
        m = x == v
        if int(m.sum()) > 1:
            ranks[m] = ranks[m].mean()
    return ranks


def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    """Pearson's correlation; NaN where either vector is constant."""
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    den = math.sqrt(float((a * a).sum()) * float((b * b).sum()))
    return float((a * b).sum()) / den if den > 0 else float("nan")


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rank correlation (average ranks for ties); NaN where either vector is constant."""
    return pearson(average_ranks(a.double()), average_ranks(b.double()))
