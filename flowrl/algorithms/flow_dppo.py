"""Flow-DPPO (arXiv 2606.11025): Flow-GRPO's rollouts and advantages with a divergence mask in place of the ratio
clip. Each trained edge keeps the mean it was sampled from; the update measures how far the policy's transition
moved from it, ``D = mean over elements (mu_theta - mu_old)^2 / (2 s^2)`` (the Gaussian KL between the two
transitions, s their std; ``divergence_std: none`` takes s = 1), and drops an edge's term only when the move is
both large (D >= ``divergence_threshold``) and in the direction its advantage pushes (ratio > 1 with A > 0, or
ratio < 1 with A < 0). The loss is ``mean(-A r)`` over the rest, with no clip: moves that correct an overshoot are
kept however far they went, which is what makes several updates per rollout stable.

Defaults are the official code's (threshold 1e-5, the KL's std, per-element mean); its SD3.5-M recipe is
``configs/sd35m_flow_dppo.yaml``. At the first step (sigma = 1) the std is the sampler kernel's own, with its
substitute for sigma = 1, as verl-omni computes it; the official code instead clamps sigma at 0.99 there."""

from __future__ import annotations

import torch

from .. import losses
from ..config import opt
from ..objectives import EdgeTerms, TrainingParts, TransitionObjective, UpdateBatch
from .transition import TransitionAlgorithm, TransitionOptions


class FlowDPPOOptions(TransitionOptions):
    divergence_threshold: float = opt(1e-5, "an edge whose transition moved by at least this KL (per element) from "
                                      "the rollout's, in its advantage's direction, is dropped", lo=0.0, lo_open=True)
    divergence_std: str = opt("transition", "the KL's std: the transition's (transition) or 1 (none)",
                              choices=["transition", "none"])


class FlowDPPO(TransitionAlgorithm):
    Options = FlowDPPOOptions
    refuses_grpo_guard = "Flow-DPPO's divergence mask replaces the ratio clip that GRPO-Guard normalises"

    def make_objective(self, parts):
        """The divergence-masked objective (:class:`DivergenceMaskedObjective`, below)."""

        return DivergenceMaskedObjective(self, parts)


class DivergenceMaskedObjective(TransitionObjective):
    """Flow-DPPO's objective: the transitions' terms with the ratio clip replaced by the divergence mask
    (:func:`flowrl.losses.divergence_masked_loss`): ``-A r`` per edge, dropped only where the edge's transition has
    moved at least ``algorithm.divergence_threshold`` (KL per element) from its rollout's in the advantage's
    direction. Logs the dropped fraction (``dppo_dropped``, and on the first update, which must be 0) and the largest
    divergence."""

    def __init__(self, algorithm, parts: TrainingParts):
        super().__init__(algorithm, parts)
        self.divergence_std = algorithm.opts.divergence_std
        self.fused = None  # the mask needs each edge's divergence: the eager path
        self.dropped, self.first_dropped, self.max_divergence = [], [], 0.0

    def policy_rows(self, log_ratio: torch.Tensor, adv: torch.Tensor, edges: EdgeTerms) -> tuple[torch.Tensor, torch.Tensor]:
        loss, ratio, dropped = losses.divergence_masked_loss(log_ratio, adv, edges.divergence,
                                                             self.algorithm.opts.divergence_threshold)
        self.dropped.append(dropped.float())
        if self.first:  # the first minibatch: the rollout's own weights, so nothing may be dropped
            self.first_dropped.append(dropped.float())
        self.max_divergence = max(self.max_divergence, float(edges.divergence.max()) if len(edges.divergence) else 0.0)
        return loss, ratio

    def work_items(self, batch: UpdateBatch, gen: torch.Generator) -> list:
        self.dropped, self.first_dropped, self.max_divergence = [], [], 0.0
        return super().work_items(batch, gen)

    def statistics(self) -> dict:
        stats = super().statistics()
        procs = self.parts.procs
        dropped = torch.cat(self.dropped) if self.dropped else torch.zeros(0)
        n, k = procs.sum(len(dropped)), procs.sum(float(dropped.sum()))
        first = torch.cat(self.first_dropped) if self.first_dropped else torch.zeros(0)
        n1, k1 = procs.sum(len(first)), procs.sum(float(first.sum()))
        stats["dppo_dropped"] = k / n if n else 0.0
        stats["dppo_dropped_first_update"] = k1 / n1 if n1 else 0.0
        stats["dppo_divergence_max"] = max(procs.gather([self.max_divergence]))
        return stats
