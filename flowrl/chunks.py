"""Chunk-GRPO (GCPO): optimise by chunks of consecutive transitions, as the Chunk-GRPO paper defines them.

A trajectory's T' trained transitions (high noise first) are partitioned into K consecutive chunks. A chunk's
ratio is the geometric mean of its step ratios, ``r_j = exp(mean_{t in chunk j} (logp_t - logp_old_t))``, and
the PPO clip applies per chunk with the trajectory's advantage. Chunk size 1 is step-level GRPO; one chunk
over all steps is the sequence-level (GSPO-like) ratio.

Boundaries: a fixed list (the released code's [2, 3, 4, 7] for 16 transitions), uniform sizes, or the v3
paper's adaptive split of the relative-L1 latent-change curve (:func:`adaptive_chunks`). Which chunks are
trained: ``int(K * fraction)`` per trajectory, drawn uniformly without replacement or with probabilities
proportional to each chunk's mean relative-L1 change (the paper's optional weighted sampling).
"""

from __future__ import annotations

import torch

from .errors import ConfigError


def relative_l1(path_latents: torch.Tensor) -> torch.Tensor:
    """(S+1, ...) latents along one path -> (S,) ``mean|x_{t+1} - x_t| / mean|x_t|`` per transition."""
    x = path_latents.flatten(1).float()
    return (x[1:] - x[:-1]).abs().mean(dim=1) / x[:-1].abs().mean(dim=1).clamp_min(1e-12)


def fixed_chunks(sizes: list[int], n: int) -> list[int]:
    if sum(sizes) != n or min(sizes, default=0) < 1:
        raise ConfigError(f"algorithm.chunk.sizes {sizes} must be positive and sum to the {n} trained transitions")
    return list(sizes)


def uniform_chunks(size: int, n: int) -> list[int]:
    """Chunks of ``size`` transitions; the last one takes the remainder."""
    sizes = [size] * (n // size)
    if n % size:
        sizes.append(n % size)
    return sizes


def adaptive_chunks(curve: list[float], min_size: int = 2, order: int = 1) -> list[int]:
    """The v3 paper's recursive split, as read here (the paper gives no code or stopping size):

    take the ``order``-th differences of the curve; transition t (t >= order) gets the sign of the difference
    ending at it, the first ``order`` transitions the sign of the first difference; consecutive transitions
    with the same sign form a chunk; if all signs agree the chunk is split at its midpoint; every chunk larger
    than ``min_size`` is split again with the next order of difference. Chunks never go below ``min_size``
    unless the curve itself is shorter.
    """
    n = len(curve)
    if n <= min_size or n <= order:
        return [n]
    c = torch.tensor(curve, dtype=torch.float64)
    d = torch.diff(c, n=order)
    signs = torch.sign(d).tolist()
    signs = [signs[0]] * order + signs  # one sign per transition
    runs, start = [], 0
    for t in range(1, n + 1):
        if t == n or signs[t] != signs[start]:
            runs.append(t - start)
            start = t
    if len(runs) == 1:
        runs = [n // 2, n - n // 2]
    runs = _merge_small(runs, min_size)
    out, pos = [], 0
    for size in runs:
        out += adaptive_chunks(curve[pos:pos + size], min_size, order + 1) if size > min_size else [size]
        pos += size
    return out


def _merge_small(runs: list[int], min_size: int) -> list[int]:
    """Merge runs shorter than ``min_size`` into their right neighbour (the last into its left one)."""
    out: list[int] = []
    carry = 0
    for r in runs:
        carry += r
        if carry >= min_size:
            out.append(carry)
            carry = 0
    if carry:
        if out:
            out[-1] += carry
        else:
            out.append(carry)
    return out


def chunk_weights(curve: torch.Tensor, sizes: list[int], norm: str = "l1") -> torch.Tensor:
    """Sampling weights ``w_j ∝ (1 / cs_j) sum_{t in chunk j} L1rel_t`` (l1-normalised or softmax)."""
    means = torch.stack([seg.mean() for seg in torch.split(curve.double(), sizes)])
    return means / means.sum() if norm == "l1" else torch.softmax(means, dim=0)


def select_chunks(num_chunks: int, n_train: int, generator: torch.Generator, weights: torch.Tensor | None = None) -> list[int]:
    """Indices of the chunks trained for one trajectory: uniform without replacement, or weighted."""
    n_train = min(max(n_train, 1), num_chunks)
    if weights is None:
        return sorted(torch.randperm(num_chunks, generator=generator)[:n_train].tolist())
    return sorted(torch.multinomial(weights.double(), n_train, replacement=False, generator=generator).tolist())


def chunk_log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor, chunk_index: torch.Tensor,
                    num_chunks: int) -> torch.Tensor:
    """Per-edge (E,) log-probs and chunk ids -> (C,) ``mean over the chunk of (logp - logp_old)``."""
    diff = log_prob - old_log_prob
    sums = torch.zeros(num_chunks, dtype=diff.dtype, device=diff.device).index_add(0, chunk_index, diff)
    counts = torch.zeros(num_chunks, dtype=diff.dtype, device=diff.device).index_add(0, chunk_index, torch.ones_like(diff))
    return sums / counts
