"""The Delightful Policy Gradient (arXiv 2603.14608) on Flow-GRPO's rollouts: every trained edge's term is
``-sg(w A) log pi`` with the gate ``w = sigmoid(A l / eta)`` and the surprisal ``l = -log pi(a | s)``; there is no
ratio and no clip. A rare action that did well (A > 0, large l) passes with w near 1; a rare action that did badly
(A < 0, large l) is damped toward 0, so unlucky exploration does not push the policy around.

The paper's experiments are bandits, token reversal and control; no flow-model code exists. The per-element-mean
Gaussian log-prob hardly varies between the samples of one step (its sample-dependent part has std about
0.7 / sqrt(latent size)), so by default the surprisal is centred and scaled over the batch (``surprisal: centred``),
which is this package's reading; ``raw`` uses the log-prob as it is, which turns the gate into a function of
(advantage, step). The method is on-policy: keep ``train.inner_epochs`` at 1."""

from __future__ import annotations

import torch

from .. import losses
from ..config import opt
from ..objectives import EdgeTerms, TrainingParts, TransitionObjective, UpdateBatch
from .transition import TransitionAlgorithm, TransitionOptions


class DelightfulPGOptions(TransitionOptions):
    eta: float = opt(1.0, "the gate's temperature: w = sigmoid(A l / eta) (the paper: 1; its analysis needs > 0.5)",
                     lo=0.0, lo_open=True)
    surprisal_clip: float = opt(10.0, "the surprisal is clipped to [-c, c] (the paper's algorithm: 10)", lo=0.0,
                                lo_open=True)
    surprisal: str = opt("centred", "centred (over the batch: which sampled actions are unusual) or raw (-log pi as "
                         "it is)", choices=["centred", "raw"])


class DelightfulPG(TransitionAlgorithm):
    Options = DelightfulPGOptions
    refuses_grpo_guard = "the Delightful Policy Gradient has no ratio to normalise"

    def make_objective(self, parts):
        """The gated objective (:class:`DelightGatedObjective`, below)."""

        return DelightGatedObjective(self, parts)


class DelightGatedObjective(TransitionObjective):
    """The Delightful Policy Gradient: no ratio clip; each edge's score-function term ``-A log pi`` is weighted by
    the detached gate ``sigmoid(A l / eta)``, where ``l = -log pi(a | s)`` is the action's surprisal
    (:func:`flowrl.losses.delight_gated_loss`), so rare successes pass and rare failures are damped. Logs the mean
    gate (``delight_gate``)."""

    def __init__(self, algorithm, parts: TrainingParts):
        super().__init__(algorithm, parts)
        self.fused = None
        self.gates: list[torch.Tensor] = []

    def policy_rows(self, log_ratio: torch.Tensor, adv: torch.Tensor, edges: EdgeTerms) -> tuple[torch.Tensor, torch.Tensor]:
        o = self.algorithm.opts
        loss, ratio, gate = losses.delight_gated_loss(log_ratio, edges.log_prob, adv, o.eta, o.surprisal_clip,
                                                      o.surprisal)
        self.gates.append(gate)
        return loss, ratio

    def work_items(self, batch: UpdateBatch, gen: torch.Generator) -> list:
        self.gates = []
        return super().work_items(batch, gen)

    def statistics(self) -> dict:
        stats = super().statistics()
        gates = torch.cat(self.gates) if self.gates else torch.zeros(0)
        n, total = self.parts.procs.sum(len(gates)), self.parts.procs.sum(float(gates.sum()))
        stats["delight_gate"] = total / n if n else 0.0
        return stats
