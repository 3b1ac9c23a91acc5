"""DanceGRPO (arXiv 2505.07818): the G samples of a prompt share one initial noise (one root that branches G
ways at the first SDE step), the last step is never trained, and each sample path trains a random
int((T - 1) * timestep_fraction) of its steps (``timestep_selection: random``)."""

from __future__ import annotations


import torch

from ..config import opt
from .transition import TransitionAlgorithm, TransitionOptions


class DanceGRPOOptions(TransitionOptions):
    shared_noise: bool = opt(True, "all G samples of a prompt start from the same noise")
    timestep_selection: str = opt("random", "first: every candidate step; random: per sample path a random "
                                  "int(candidates * timestep_fraction) of them", choices=["first", "random"])


def last_step_untrained(t: int) -> list[bool]:
    """Steps 0..T-2 are candidates (the last step's sample is scored, not trained)."""
    return [i < t - 1 or t == 1 for i in range(t)]


class DanceGRPO(TransitionAlgorithm):
    Options = DanceGRPOOptions

    def trained_steps(self, t: int) -> list[bool]:
        return last_step_untrained(t)

    def select_edges(self, tree, gen: torch.Generator) -> list[torch.Tensor]:
        """Each root-to-leaf path keeps a random int(n_candidates * timestep_fraction) of its candidate rounds;
        an edge shared by several paths is trained if any leaf below it chose its round."""
        masks = [m.clone() for m in tree.trained]
        if self.opts.timestep_selection != "random":
            return masks
        candidates = [r for r in range(1, tree.num_rounds + 1) if bool(tree.trained[r].any())]
        keep = max(1, int(len(candidates) * self.opts.timestep_fraction))
        leaf_round, leaf_pos = tree.leaf_positions()
        n_leaves = leaf_pos.numel()
        chosen = torch.zeros(n_leaves, tree.num_rounds + 1, dtype=torch.bool)  # rounds trained on each leaf's path
        for leaf in range(n_leaves):
            perm = torch.randperm(len(candidates), generator=gen)[:keep]
            chosen[leaf, [candidates[i] for i in perm.tolist()]] = True
        node = torch.full((n_leaves,), -1)  # walk each leaf's path upwards
        for r in range(tree.num_rounds, 0, -1):
            node = torch.where(leaf_round == r, leaf_pos, node)
            on = node >= 0
            sel = torch.zeros(tree.latents[r].shape[0], dtype=torch.bool)
            sel.index_fill_(0, node[on & chosen[:, r]], True)
            masks[r] &= sel
            node = torch.where(on, tree.parent[r][node.clamp_min(0)], node)
        return masks
