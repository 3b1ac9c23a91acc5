"""TempFlow-GRPO (arXiv 2508.04324): per initial noise an ODE main line; at every active step K one-step
SDE side branches, each completed by ODE and scored; one advantage group per (prompt or seed, active step),
so credit lands on the step that branched; each step's loss weighted by its transition std sigma_t sqrt(dt),
times 2.25 as in the released code (``scaled_std``: mean 0.999 over SD3's 10-step grid at a = 0.7) or normalised
to mean 1 over the trained steps (``noise_aware``). The side-branch tree itself, shared with E-GRPO and AdaGRPO, is
:class:`~flowrl.algorithms.side_branch.SideBranchAlgorithm`."""

from __future__ import annotations

import torch

from ..config import opt
from .side_branch import SideBranchAlgorithm, SideOptions


class TempFlowOptions(SideOptions):
    loss_weight: str = opt("scaled_std", "per-step loss weight: scaled_std (2.25 sigma_t sqrt(dt), the released "
                           "code), noise_aware (sigma_t sqrt(dt) over its mean across the trained steps) or none",
                           choices=["scaled_std", "noise_aware", "none"])


class TempFlowGRPO(SideBranchAlgorithm):
    Options = TempFlowOptions
    # the released code (scripts/train_sd3_pr.py) keeps CFG's unconditional half in the graph
    cfg_unconditional_grad = True

    def loss_weights(self, tree, masks) -> dict[int, float] | None:
        """Each trained step's transition std sigma_t sqrt(dt), times 2.25 (``scaled_std``) or over its mean across
        the trained steps (``noise_aware``)."""
        if self.opts.loss_weight == "none":
            return None
        per_step: dict[int, float] = {}
        for r in range(1, tree.num_rounds + 1):
            for c in torch.nonzero(masks[r]).flatten().tolist():
                per_step.setdefault(int(tree.index[r - 1][tree.parent[r][c]]), float(tree.std[r][c]))
        if self.opts.loss_weight == "scaled_std":
            return {k: 2.25 * v for k, v in per_step.items()}
        mean = sum(per_step.values()) / max(len(per_step), 1)
        return {k: v / mean for k, v in per_step.items()} if mean > 0 else {k: 1.0 for k in per_step}
