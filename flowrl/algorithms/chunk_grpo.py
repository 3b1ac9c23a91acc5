"""Chunk-GRPO (GCPO, arXiv 2510.21583): a sample path's trained transitions (high noise first) are split into
consecutive chunks; a chunk's ratio is the geometric mean of its step ratios and the PPO clip applies per chunk
with the path's advantage. ``int(K * timestep_fraction)`` chunks are trained per path, drawn uniformly or by
each chunk's latent change. Chunk maths: flowrl/chunks.py."""

from __future__ import annotations


import torch

from .. import chunks as ch
from ..config import opt
from ..errors import ConfigError
from .base import Unit
from .dance_grpo import last_step_untrained
from .transition import TransitionAlgorithm, TransitionOptions


class ChunkGRPOOptions(TransitionOptions):
    timestep_fraction: float = opt(0.5, "fraction of a path's chunks trained each iteration", lo=0.0, hi=1.0,
                                   lo_open=True)
    mode: str = opt("fixed", "fixed sizes (the released code), uniform size, or the v3 paper's adaptive split",
                    choices=["fixed", "uniform", "adaptive"])
    sizes: list[int] = opt([2, 3, 4, 7], "fixed: chunk sizes, high noise first; must sum to the trained transitions")
    size: int = opt(4, "uniform: transitions per chunk", lo=1)
    min_size: int = opt(2, "adaptive: chunks are not split below this size", lo=1)
    sampling: str = opt("uniform", "which chunks are trained: uniform without replacement, or weighted by the "
                        "chunk's mean relative-L1 latent change", choices=["uniform", "weighted"])
    weight_norm: str = opt("l1", "weighted sampling: l1-normalised means or their softmax", choices=["l1", "softmax"])


class ChunkGRPO(TransitionAlgorithm):
    Options = ChunkGRPOOptions
    per_edge_rows = False  # rows are chunks

    @classmethod
    def check(cls, cfg) -> None:
        o, t = cfg.algorithm, cfg.sampler.num_steps
        n = o.window.size if o.window.size else sum(last_step_untrained(t))  # trained transitions per path
        if o.mode == "fixed" and (sum(o.sizes) != n or min(o.sizes, default=0) < 1):
            where = f"the window of {o.window.size}" if o.window.size else f"steps 0..{t - 2} of sampler.num_steps={t}"
            raise ConfigError(f"algorithm.sizes {o.sizes} must be positive and sum to the {n} trained transitions "
                              f"({where})")

    def trained_steps(self, t: int) -> list[bool]:
        return last_step_untrained(t)

    def work_items(self, tree, node_adv, masks, gen: torch.Generator) -> list[list[Unit]]:
        """Per leaf path, its selected chunks, each a list of one-edge units (high noise first). Leaves with zero
        advantage are skipped unless a KL term needs them."""
        o = self.opts
        rounds = [r for r in range(1, tree.num_rounds + 1) if bool(tree.trained[r].any())]
        leaf_round, leaf_pos = tree.leaf_positions()
        items = []
        for lr, lp in zip(leaf_round.tolist(), leaf_pos.tolist()):
            path = [0] * (lr + 1)  # node position at every round of this leaf's path
            path[lr] = lp
            for r in range(lr, 0, -1):
                path[r - 1] = int(tree.parent[r][path[r]])
            if node_adv[lr][lp] == 0 and self.cfg.train.kl_beta == 0:
                continue
            curve = ch.relative_l1(torch.stack([tree.latents[r][path[r]] for r in [rounds[0] - 1] + rounds]))
            if o.mode == "fixed":
                sizes = ch.fixed_chunks(o.sizes, len(rounds))
            elif o.mode == "uniform":
                sizes = ch.uniform_chunks(o.size, len(rounds))
            else:
                sizes = ch.adaptive_chunks(curve.tolist(), o.min_size)
            weights = ch.chunk_weights(curve, sizes, o.weight_norm) if o.sampling == "weighted" else None
            starts = [sum(sizes[:j]) for j in range(len(sizes))]
            for j in ch.select_chunks(len(sizes), int(len(sizes) * o.timestep_fraction), gen, weights):
                items.append([Unit(r - 1, path[r - 1], [path[r]]) for r in rounds[starts[j]:starts[j] + sizes[j]]])
        return items

    def item_rows(self, item: list[Unit]) -> int:
        return 1  # one loss row per chunk

    def loss_rows(self, items, log_prob, old_log_prob, adv, kl, step):
        """(E,) edges -> (C,) chunks: the mean log-ratio (geometric-mean ratio) and mean KL of each chunk, with
        the advantage and step of its first edge."""
        cid = torch.tensor([k for k, it in enumerate(items) for _ in it], device=log_prob.device)
        first = torch.tensor([0] + [len(it) for it in items[:-1]]).cumsum(0)
        log_ratio = ch.chunk_log_ratio(log_prob, old_log_prob, cid, len(items))
        kl = ch.chunk_log_ratio(kl, torch.zeros_like(kl), cid, len(items))
        return log_ratio, adv[first.to(adv.device)], kl, step[first]
