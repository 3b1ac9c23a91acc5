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

from ..config import opt
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
        """The divergence-masked objective (:class:`flowrl.objectives.DivergenceMaskedObjective`)."""
        from ..objectives import DivergenceMaskedObjective

        return DivergenceMaskedObjective(self, parts)
