"""The transition kind: algorithms whose loss is over the sampler's trained transitions (edges of the rollout
tree), through each edge's log-probability under the policy and under the rollout's weights. Flow-GRPO and the
methods that change its plan, its edges, its rows or its ratio's loss build on :class:`TransitionAlgorithm`."""

from __future__ import annotations

import random

import torch

from ..config import opt
from ..objectives import TransitionObjective
from ..samplers import RolloutPlan, StepSpec
from .base import Algorithm, Unit, WindowedOptions, declares, window_steps


class TransitionOptions(WindowedOptions):
    timestep_fraction: float = opt(0.99, "the first int(T * f) steps are trained (without a window)", lo=0.0, hi=1.0,
                                   lo_open=True)


class TransitionAlgorithm(Algorithm):
    """Every step SDE (or only a window's), G samples per prompt, the first int(T * timestep_fraction) steps
    trained, one work item per parent state with its trained edges, PPO-clip on each edge's ratio
    (:class:`~flowrl.objectives.TransitionObjective`). A method with its own tree shape overrides :meth:`plan`
    (its ``Options`` then need not be :class:`TransitionOptions`).

    Its own hooks, called by the transition objective during the update: :meth:`work_items` / :meth:`item_rows` /
    :meth:`loss_rows` (the unit of gradient work and how per-edge log-ratios become loss rows: per edge here, per
    chunk in Chunk-GRPO) and :meth:`loss_weights` (per-step weights).
    """

    Options = TransitionOptions
    per_edge_rows = True  # loss_rows keeps one row per edge (so train.fused_loss can clip per edge)
    # loss_rows is the package's per-edge form with the KL as given, so the compiled fused loss computes the same
    # rows (an algorithm that reweights rows or KLs in loss_rows sets False)
    fusable_loss_rows = True

    # ------------------------------------------------------------------------------------------ plan
    def trained_steps(self, t: int) -> list[bool]:
        """Training candidates without a window: the first int(T * timestep_fraction) steps."""
        n_train = max(1, min(int(t * self.opts.timestep_fraction), t))
        return [i < n_train for i in range(t)]

    def plan(self, it: int, rng: random.Random | None = None, sigmas: torch.Tensor | None = None) -> RolloutPlan:
        t, o = self.cfg.sampler.num_steps, self.opts
        rng = rng or random.Random(self.cfg.train.seed * 1000003 + it)
        if o.window.size == 0:
            sde, trained, notes = [True] * t, self.trained_steps(t), {}
        else:  # hybrid ODE-SDE sampling: SDE and training only inside the window
            start, stop = window_steps(o.window, t, it, rng)
            sde = [start <= i < stop for i in range(t)]
            trained, notes = list(sde), {"window_start": start}
        steps = [StepSpec(sde=s, trained=tr) for s, tr in zip(sde, trained)]
        roots, shared = self.group()
        if shared and not any(sde):  # an empty window (MixGRPO's last position): one ODE sample, nothing trained
            roots = 1
        elif shared:  # one root per prompt that branches G ways at the first SDE step
            first_sde = steps[sde.index(True)]
            first_sde.branch = roots
            if declares(self.Options, "antithetic") and o.antithetic:
                first_sde.sibling_noise = "antithetic"
            roots = 1
        return RolloutPlan(steps, roots_per_prompt=roots, notes=notes)

    def group(self) -> tuple[int, bool]:
        """(samples per prompt in the plan, whether they share one initial noise)."""
        return self.opts.group_size, self.opts.shared_noise

    # ------------------------------------------------------------------------------------------ the update
    def work_items(self, tree, node_adv, masks, gen: torch.Generator) -> list[list[Unit]]:
        """Group the trained edges into work items, the unit the update's micro-batches are made of.

        One item per parent state with all its trained edges. Edges with zero advantage carry no policy gradient
        and are skipped unless a KL term needs them.

        Args:
            tree: the rollout's tree.
            node_adv: per round, (N_r,) advantages.
            masks: per round, (N_r,) bool masks of the edges to train.
            gen: the iteration's generator.
        Returns:
            Per minibatch-able group, a list of :class:`~flowrl.algorithms.base.Unit` items.
        """
        keep_zero = self.cfg.train.kl_beta > 0
        items = []
        for d in range(1, tree.num_rounds + 1):
            sel = masks[d] if keep_zero else masks[d] & (node_adv[d] != 0)
            children = torch.nonzero(sel).flatten()
            by_parent: dict[int, list[int]] = {}
            for c, p in zip(children.tolist(), tree.parent[d][children].tolist()):
                by_parent.setdefault(p, []).append(c)
            items += [[Unit(d - 1, p, cs)] for p, cs in by_parent.items()]
        return items

    def item_rows(self, item: list[Unit]) -> int:
        """Loss rows an item contributes (the loss is their mean over the minibatch)."""
        return sum(len(u.children) for u in item)

    def loss_rows(self, items: list[list[Unit]], log_prob, old_log_prob, adv, kl, step):
        """Per-edge (E,) terms of a micro-batch of items -> per-row (log-ratio, advantage, kl, step index)."""
        return log_prob - old_log_prob, adv, kl, step

    def loss_weights(self, tree, masks) -> dict[int, float] | None:
        """A loss weight per denoising step.

        Args:
            tree: the rollout's tree.
            masks: per round, the (N_r,) trained-edge masks.
        Returns:
            ``{grid index of the parent: weight}``, or None for a weight of 1 everywhere.
        """
        return None

    def make_objective(self, parts):
        """PPO-clip on the rollout's transitions (:class:`~flowrl.objectives.TransitionObjective`)."""
        return TransitionObjective(self, parts)
