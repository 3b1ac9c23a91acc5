"""Training objectives: what an optimizer step minimises, given one iteration's rollout.

An algorithm chooses its objective (:meth:`flowrl.algorithms.Algorithm.make_objective`); the trainer's one
optimisation loop (:func:`flowrl.optimise.optimise`) drives it through the small :class:`Objective` protocol:

1. :meth:`~Objective.work_items` turns the iteration into units of gradient work (drawing what it needs);
2. per minibatch, :meth:`~Objective.begin_minibatch`, then :meth:`~Objective.micro_batch_loss` for each
   micro-batch of this process's share, then :meth:`~Objective.end_minibatch` (extra terms of the minibatch);
3. :meth:`~Objective.statistics` after the last step: the update's numbers, gathered over processes.

Two shared kinds live here. :class:`TransitionObjective` scores the sampler's own stochastic transitions (log-prob
of each trained edge, ratio to the rollout's, PPO clip, KLs to a reference at the trained and the untrained steps,
GRPO-Guard's normalised ratio as an option, a compiled fused path): every GRPO-style method.
:class:`ForwardProcessObjective` re-noises the clean samples and applies the algorithm's per-sample loss on the
forward process (DiffusionNFT, AWM, SFT, AC-Flow). A method with a loss of its own keeps it in its algorithm's
module, subclassing one of these or :class:`Objective` (Flow-DPPO's divergence mask, the Delightful PG's gate,
on-policy distillation, online DPO's pairs, DGPO's groups, ReFL's reward backpropagation).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from . import losses
from .engine import to_device
from .errors import FlowRLError
from .losses import gaussian_kl_same_std, guard_log_ratio, kl_std, ppo_clip_loss
from .samplers.kernels import step as kernel_step


@dataclass
class TrainingParts:
    """What an objective computes with: the model adapter, the trained policy (weights, reference, old and EMA
    copies, its accelerator), the process group, the rollout grid and the negative prompt's conditioning for CFG,
    and the kernel options of the configured sampler."""

    cfg: Any  # flowrl.config.Config
    adapter: Any  # a flowrl.models.base.ModelAdapter
    policy: Any  # flowrl.policy.Policy
    procs: Any  # flowrl.distributed.Processes
    sigmas: torch.Tensor  # (T + 1,) the rollout grid
    negative: Any  # the negative prompt's conditioning (CFG), or None
    kernel_options: dict  # extra keyword arguments of the step kernel (flowrl.sampling.kernel_options)
    rewards: Any = None  # the run's reward set (an objective that differentiates the reward scores with it)

    @property
    def device(self) -> torch.device:
        return self.adapter.device

    @property
    def accelerator(self):
        return self.policy.accelerator


@dataclass
class UpdateBatch:
    """One iteration's rollout as the objective sees it."""

    tree: Any  # flowrl.engine.Tree
    cond: Any  # the prompts' conditioning, indexed by prompt row
    node_adv: list[torch.Tensor]  # per round (N_r,): the advantage of the edge into each node
    masks: list[torch.Tensor]  # per round (N_r,) bool: that edge is trained this iteration
    prompts: list[str] = field(default_factory=list)  # the prompt of each prompt row
    metadata: list[dict] | None = None  # each prompt row's metadata (GenEval's clauses), where the prompts have it
    pairs: list[tuple[int, int]] | None = None  # (chosen, rejected) leaf indices, for preference objectives


@dataclass
class EdgeTerms:
    """One micro-batch's per-edge terms, all (E,): what a transition objective's :meth:`policy_rows` may read
    besides the rows' log-ratio and advantage."""

    log_prob: torch.Tensor  # log pi_theta of each edge's sampled transition (with its graph)
    old_log_prob: torch.Tensor  # the rollout's log-prob of the same transition
    adv: torch.Tensor  # the edge's advantage (clipped to +-advantage.clip)
    kl: torch.Tensor  # the KL to the reference transition (0 without a KL)
    step: torch.Tensor  # the grid index of the edge's parent state
    divergence: torch.Tensor | None = None  # the KL from the rollout's transition, where the objective asks for it


class Objective:
    """What the optimisation loop (:func:`flowrl.optimise.optimise`) needs of a loss: work items it can deal to
    processes and pack into micro-batches, each item's size and rows, and the summed loss of a micro-batch. Every
    objective subclasses it; the loop calls nothing else.

    The loop calls :meth:`work_items` once per update, then per minibatch :meth:`begin_minibatch`,
    :meth:`micro_batch_loss` for each micro-batch (and backward), :meth:`end_minibatch`, the optimizer step, then
    :meth:`after_optimizer_step`, and finally :meth:`statistics`.
    """

    trains_transitions = False  # the loss is over the plan's trained edges (else over re-noised or re-run samples)
    # train.update_composition=rollout is possible: group_key puts each rollout call's items in one micro-batch
    keys_rollout_calls = False

    @property
    def needs_sampling_mean(self) -> bool:
        """Whether the rollout must keep each trained edge's sampling mean (one latent per edge)."""
        return False

    def work_items(self, batch: UpdateBatch, gen: torch.Generator) -> list:
        """The update's work items.

        Args:
            batch: the rollout's tree, advantages and trained-edge masks.
            gen: the iteration's generator.
        Returns:
            Per minibatch-able group, the items (their order is the same on every process).
        """
        raise NotImplementedError

    def item_size(self, item) -> int:
        """Transformer inputs one item puts through a forward (its share of the micro-batch)."""
        raise NotImplementedError

    def item_rows(self, item) -> int:
        """Loss rows the item contributes; a minibatch's loss is the mean over its rows."""
        raise NotImplementedError

    def group_key(self, item) -> int | None:
        """The rollout call an item belongs to (the loop keeps one call's items in one micro-batch), or None: the
        loop packs micro-batches by size."""
        return None

    def begin_minibatch(self, items: list, gen: torch.Generator) -> None:
        """Before a minibatch's micro-batches."""

    def micro_batch_loss(self, numbered: list[tuple[int, Any]], record: bool = True) -> torch.Tensor:
        """The summed loss of one micro-batch's rows.

        Args:
            numbered: ``(place in the minibatch, item)`` pairs (places are the same on every process).
            record: False for padding work in sharded training, kept out of the statistics.
        Returns:
            A scalar tensor: the sum over the micro-batch's rows, already divided by the whole minibatch's rows.
        """
        raise NotImplementedError

    def end_minibatch(self, gen: torch.Generator) -> torch.Tensor | None:
        """After the micro-batches' backwards: an extra loss of the minibatch to back-propagate, or None."""
        return None

    def after_optimizer_step(self) -> None:
        """After each optimizer step (a copy of the weights that follows every step updates here)."""

    def statistics(self) -> dict:
        """The update's numbers, gathered over processes, after the last step."""
        raise NotImplementedError


def velocities(parts: TrainingParts, x: torch.Tensor, sigma: torch.Tensor, cond, with_reference: bool,
               references: list[tuple[str, torch.Tensor]] | None = None):
    """(v, v_ref or None) at the states x (N, *latent): the policy's velocity with its graph, and the KL
    reference's without one. The reference goes first: an EMA reference swaps the weights in place, which must
    not touch v's graph. ``references``: (name, row positions) pairs, each rows' v_ref from the named reference
    (``Policy.reference(name)``) instead of the default one; a name with no rows still makes its pass (on the first
    state, dropped), so that sharded processes make the same calls whatever their rows."""
    cfg, policy = parts.cfg, parts.policy
    g = cfg.sampler.guidance_scale if cfg.train.cfg else 1.0
    v_ref = None
    if with_reference and references is not None:
        parts_ref = []
        with torch.no_grad(), policy.accelerator.autocast():
            for name, idx in references:
                run = idx if len(idx) else idx.new_zeros(1)
                with policy.reference(name):
                    v_part = parts.adapter.velocity(x[run], sigma[run], cond.index(run), g, parts.negative)
                parts_ref.append((idx, v_part[: len(idx)]))
        v_ref = torch.empty((x.shape[0], *parts_ref[0][1].shape[1:]), dtype=parts_ref[0][1].dtype, device=x.device)
        for idx, v_part in parts_ref:
            v_ref[idx] = v_part
    elif with_reference:
        with torch.no_grad(), policy.reference(), policy.accelerator.autocast():
            v_ref = parts.adapter.velocity(x, sigma, cond, g, parts.negative)
    # the published update keeps CFG's unconditional half out of the graph (train.cfg_unconditional_grad)
    detach = g > 1 and parts.negative is not None and not cfg.train.cfg_unconditional_grad
    with policy.accelerator.autocast():
        v = parts.adapter.velocity(x, sigma, cond, g, parts.negative, **({"unconditional_grad": False} if detach else {}))
    return v, v_ref


class TransitionObjective(Objective):
    """PPO-clip on the sampler's transitions. Each work item is a parent state with its trained edges (or a chunk
    of them, Chunk-GRPO); one transformer pass per parent serves all its edges. The algorithm turns per-edge
    log-ratios into loss rows (:meth:`loss_rows`: per edge, per chunk) and may weight steps (:meth:`loss_weights`).

    Terms per row: ``max(-A r, -A clip(r))`` with ``r = exp(logp - logp_old)`` (the mean-over-elements log-prob),
    plus ``train.kl_beta`` x the Gaussian KL to the reference transition; per minibatch, ``train.kl_untrained_beta``
    x the mean KL at ``train.kl_untrained_states`` states of the untrained (ODE) steps. ``train.grpo_guard`` replaces
    each edge's log-ratio by GRPO-Guard's centred, std-scaled form and divides each step's loss by its |dt|."""

    def __init__(self, algorithm, parts: TrainingParts):
        self.algorithm, self.parts, self.cfg = algorithm, parts, algorithm.cfg
        self.guard = self.cfg.train.grpo_guard
        # GRPO-Guard rewrites the log-ratio: the eager path
        self.fused = (losses.compiled_edge_objective() if self.cfg.train.fused_loss and algorithm.per_edge_rows
                      and algorithm.fusable_loss_rows and not self.guard else None)
        # train.update_composition=rollout: each parent state is recomputed inside the rollout call that evaluated it
        self.same_composition = self.cfg.train.update_composition == "rollout"

    divergence_std: str | None = None  # set by objectives that need each edge's divergence from its rollout
    trains_transitions = True  # the loss is over the plan's trained edges
    keys_rollout_calls = True

    @property
    def needs_sampling_mean(self) -> bool:
        """The rollout must keep each edge's sampling mean (GRPO-Guard's normalisation and the divergence from the
        rollout's transition need the old mean)."""
        return self.guard or self.divergence_std is not None

    def policy_rows(self, log_ratio: torch.Tensor, adv: torch.Tensor, edges: EdgeTerms) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy term per loss row: PPO's clipped surrogate ``max(-A r, -A clip(r))``.

        Args:
            log_ratio: (R,) log(pi_theta / pi_old) per row.
            adv: (R,) advantages.
            edges: the micro-batch's per-edge terms (an objective with per-edge rows, R = E, may read them).
        Returns:
            ``(loss (R,), ratio (R,))``.
        """
        return ppo_clip_loss(log_ratio, torch.zeros_like(log_ratio), adv, self.cfg.train.clip_range)

    # ------------------------------------------------------------------------------------------ the update
    def work_items(self, batch: UpdateBatch, gen: torch.Generator) -> list:
        algo, tree, cfg = self.algorithm, batch.tree, self.cfg
        self.batch = batch
        items = algo.work_items(tree, batch.node_adv, batch.masks, gen)
        self.weights = algo.loss_weights(tree, batch.masks)
        if self.guard:  # GRPO-Guard's per-step reweighting: each step's loss divided by its |dt|
            dt = (tree.sigmas[:-1] - tree.sigmas[1:]).abs().tolist()
            self.weights = {i: (self.weights or {}).get(i, 1.0) / d for i, d in enumerate(dt) if d > 0}
        self.untrained = untrained_states(tree) if cfg.train.kl_untrained_beta > 0 else None
        self.rows = {k: [] for k in ("ratio", "clipped", "kl", "policy_loss", "approx_kl", "step", "minibatch")}
        self.untrained_kls, self.mb_ratios, self.first, self.minibatch = [], [], True, -1
        self.nfe, self.first_deviation, self.first_log_ratio = 0, 0.0, 0.0
        self.calls = tree.rollout_calls() if self.same_composition else {}
        if self.same_composition and not self.calls:
            raise FlowRLError("train.update_composition=rollout: this rollout did not record its transformer calls")
        self.trained_edges = sum(len(u.children) for it in items for u in it)
        self.num_items = len(items)
        return items

    def item_size(self, item) -> int:
        return len(item)

    def item_rows(self, item) -> int:
        return self.algorithm.item_rows(item)

    def group_key(self, item) -> int | None:
        """train.update_composition=rollout: the rollout call of the item's first parent state (the optimisation
        loop puts the items of one call in one micro-batch); None otherwise."""
        if not self.same_composition:
            return None
        first = item[0]
        return int(self.batch.tree.rounds[first.depth].call[first.parent])

    def begin_minibatch(self, items: list, gen: torch.Generator) -> None:
        self.mb_ratios = []
        self.minibatch += 1  # each minibatch is one optimizer step

    def micro_batch_loss(self, numbered: list[tuple[int, Any]], record: bool = True) -> torch.Tensor:
        cfg = self.cfg
        group = [item for _, item in numbered]
        units = [u for it in group for u in it]
        edges, fused = self._edge_terms(units)
        logp, old, adv, kl, step = edges.log_prob, edges.old_log_prob, edges.adv, edges.kl, edges.step
        if fused is not None:  # per-edge rows, computed whole by the compiled objective
            loss_r, ratio = fused
        else:
            log_ratio, adv, kl, step = self.algorithm.loss_rows(group, logp, old, adv, kl, step)  # (E,) -> (R,)
            loss_r, ratio = self.policy_rows(log_ratio, adv, edges)
        row_loss = loss_r + cfg.train.kl_beta * kl
        if self.weights is not None:  # (R,) the weight of each row's step
            row_loss = row_loss * to_device(torch.tensor([self.weights[int(i)] for i in step]), row_loss.device)
        if not record:
            return row_loss.sum()
        self.nfe += self.forwarded
        ratio = ratio.detach()
        self.mb_ratios.append(ratio)
        r = self.rows
        r["ratio"].append(ratio)
        r["clipped"].append(((ratio - 1).abs() > cfg.train.clip_range).float())
        r["kl"].append(kl.detach())
        r["policy_loss"].append(loss_r.detach())
        r["approx_kl"].append(0.5 * (logp.detach() - old) ** 2)
        r["step"].append(step)
        r["minibatch"].append(torch.full_like(step, self.minibatch))
        return row_loss.sum()

    def end_minibatch(self, gen: torch.Generator) -> torch.Tensor | None:
        cfg, procs = self.cfg, self.parts.procs
        if self.first:  # the first minibatch sees the rollout's own weights: every ratio is 1 up to float error
            ratios = torch.cat(self.mb_ratios) if self.mb_ratios else torch.ones(0)
            mine = (float((ratios - 1).abs().max()) if len(ratios) else 0.0, float(ratios.log().abs().sum()),
                    len(ratios))
            every = procs.gather([mine])  # the max |ratio - 1| and mean |log ratio| over every process's rows
            self.first_deviation = max(d for d, _, _ in every)
            self.first_log_ratio = sum(s for _, s, _ in every) / max(1, sum(n for _, _, n in every))
            self.first = False
        if self.untrained is None or not len(self.untrained[0]):
            return None
        pick = torch.randperm(len(self.untrained[0]), generator=gen)[:cfg.train.kl_untrained_states]
        mine = torch.tensor(procs.share(pick.tolist()), dtype=torch.long)  # the draw is shared across processes
        if not len(mine):
            if self.parts.policy.sharded and len(pick):  # the others' forwards are collectives: join with weight 0
                return 0.0 * self._untrained_kl(self.untrained[0][pick[:1]], self.untrained[1][pick[:1]]).sum()
            return None
        ukl = self._untrained_kl(self.untrained[0][mine], self.untrained[1][mine])
        self.nfe += len(mine)
        self.untrained_kls.append(ukl.detach())
        return cfg.train.kl_untrained_beta * ukl.sum() / len(pick)

    def statistics(self) -> dict:
        procs = self.parts.procs
        stats = {"trained_edges": self.trained_edges, "work_items": self.num_items, "nfe_train": 0}
        if not self.num_items:  # nothing trained: no ratio, loss or KL was measured
            return stats
        r = self.rows  # every process's rows, so the statistics are the whole update's
        ratios, clipped, approx, kls, pls, steps, mbs = procs.gather_rows(
            r["ratio"], r["clipped"], r["approx_kl"], r["kl"], r["policy_loss"], r["step"], r["minibatch"])
        ratio = torch.cat(ratios).cpu()
        step, kl, minibatch = torch.cat(steps), torch.cat(kls).cpu(), torch.cat(mbs).cpu()
        # each optimizer step's mean KL, the largest of them (GARDO's reference reset reads it)
        step_kl = max(float(kl[minibatch == m].mean()) for m in minibatch.unique().tolist())
        stats.update({
            "nfe_train": procs.sum(self.nfe), "ratio_max_abs_dev_first_update": self.first_deviation,
            "mean_abs_log_ratio_first_update": self.first_log_ratio,
            "clipfrac": float(torch.cat(clipped).mean()), "approx_kl": float(torch.cat(approx).mean()),
            "ratio_mean": float(ratio.mean()), "ratio_std": float(ratio.std(correction=0)),
            "policy_loss": float(torch.cat(pls).mean()), "kl_loss": float(kl.mean()),
            "kl_loss_step_max": step_kl, "mean_abs_log_ratio": float(ratio.log().abs().mean()),
        })
        if self.untrained is not None:  # this process's states (the mean differs little across processes)
            stats["kl_untrained"] = float(torch.cat(self.untrained_kls).mean()) if self.untrained_kls else 0.0
        for step_idx in step.unique().tolist():
            stats[f"ratio_mean/step{step_idx}"] = float(ratio[step == step_idx].mean())
        return stats

    # ------------------------------------------------------------------------------------------ the terms
    def velocities(self, x: torch.Tensor, sigma: torch.Tensor, rows: torch.Tensor, with_reference: bool):
        """(v, v_ref or None) at states x (N, *latent) of the prompts ``rows`` (N,) of this update's batch."""
        return velocities(self.parts, x, sigma, self.batch.cond.index(rows), with_reference)

    def _velocities_in_rollout_calls(self, p_rnd: torch.Tensor, p_pos: torch.Tensor, with_reference: bool):
        """(v, v_ref or None) of the parent states (U,) by round and position, each computed in the rollout's own
        call: every call that evaluated one of them runs again with all its rows in their order (bf16 kernels may
        round a row differently in another batch), and the parents' rows are taken from it."""
        tree, dev = self.batch.tree, self.parts.device
        call = tree.gather(tree.call, p_rnd, p_pos).tolist()  # (U,) each parent's call and its row there
        slot = tree.gather(tree.slot, p_rnd, p_pos)
        v = v_ref = None
        self.forwarded = 0
        for c in dict.fromkeys(call):  # each call once, in the order the parents first need it
            rounds, positions = self.calls[c]
            x = tree.gather(tree.latents, rounds, positions).to(dev)  # (n, *latent) the call's rows, in order
            sig = to_device(tree.sigmas[tree.gather(tree.index, rounds, positions)], dev)
            rows = to_device(tree.gather(tree.group, rounds, positions), dev)
            v_call, ref_call = self.velocities(x, sig, rows, with_reference)
            self.forwarded += len(rounds)
            mine = torch.tensor([k for k, ck in enumerate(call) if ck == c])  # (m,) the parents this call evaluated
            if v is None:
                v = v_call.new_empty((len(call), *v_call.shape[1:]))
                v_ref = None if ref_call is None else ref_call.new_empty((len(call), *ref_call.shape[1:]))
            mine_d, slot_d = to_device(mine, dev), to_device(slot[mine], dev)
            v = v.index_put((mine_d,), v_call[slot_d])  # out of place: the graph flows to v_call
            if ref_call is not None:
                v_ref[mine_d] = ref_call[slot_d]
        return v, v_ref

    def _edge_terms(self, units: list):
        """Forward one micro-batch of parent states; returns the per-edge :class:`EdgeTerms` and the fused path's
        (loss, ratio) or None."""
        cfg, parts, tree = self.cfg, self.parts, self.batch.tree
        dev = parts.device
        p_rnd = torch.tensor([u.depth for u in units])  # (U,) round and position of each parent state
        p_pos = torch.tensor([u.parent for u in units])
        x = tree.gather(tree.latents, p_rnd, p_pos).to(dev)  # (U, *latent)
        parent_index = tree.gather(tree.index, p_rnd, p_pos)
        if self.same_composition:
            v, v_ref = self._velocities_in_rollout_calls(p_rnd, p_pos, cfg.train.kl_beta > 0)
        else:
            sig = to_device(tree.sigmas[parent_index], dev)
            rows = to_device(tree.gather(tree.group, p_rnd, p_pos), dev)
            v, v_ref = self.velocities(x, sig, rows, cfg.train.kl_beta > 0)  # (U, *latent)
            self.forwarded = len(units)
        # expand parents to their child edges: (E,) per-edge parent slot, child round and position
        # every host-to-device copy below is asynchronous (to_device): the update waits for the device only where
        # it reads a value (the gradient norm), not per micro-batch or per round
        pos_host = torch.tensor([i for i, u in enumerate(units) for _ in u.children])
        pos = to_device(pos_host, dev)
        rnd = torch.tensor([u.depth + 1 for u in units for _ in u.children])
        child = torch.tensor([c for u in units for c in u.children])
        prev = tree.gather(tree.latents, rnd, child).to(dev)
        old = tree.gather(tree.log_prob, rnd, child)
        adv = tree.gather(self.batch.node_adv, rnd, child).float()
        level = tree.gather(tree.level, rnd, child)
        s = tree.sigmas[parent_index[pos_host]]
        s_next = tree.sigmas[tree.gather(tree.index, rnd, child)]
        logp = torch.empty(len(child), device=dev)
        kl = torch.zeros(len(child), device=dev)
        divergence = torch.zeros(len(child), device=dev) if self.divergence_std is not None else None
        adv = to_device(adv, dev).clamp(-cfg.advantage.clip, cfg.advantage.clip)
        s_d, s_next_d, old_d = to_device(s, dev), to_device(s_next, dev), to_device(old, dev)
        options = parts.kernel_options
        sigma_at_one = float(tree.sigmas[1])
        fused = self.fused
        loss_and_ratio = (torch.empty(len(child), device=dev), torch.empty(len(child), device=dev)) if fused else None
        for lv in level.unique().tolist():  # the kernels take one noise level per call
            m = (level == lv).nonzero().flatten()
            md = to_device(m, dev)
            if fused:  # log-prob, ratio, clip and KL in one compiled function
                loss_m, ratio_m, logp[md], kl[md] = fused(
                    x[pos[md]], v[pos[md]], s_d[md], s_next_d[md], prev[md], old_d[md], adv[md],
                    None if v_ref is None else v_ref[pos[md]], kernel=cfg.sampler.kernel, noise_level=lv,
                    sigma_at_one=sigma_at_one, clip_range=cfg.train.clip_range, reduce=cfg.train.log_prob_reduce,
                    kl_std_mode=cfg.train.kl_std, kernel_options=options)
                loss_and_ratio[0][md], loss_and_ratio[1][md] = loss_m, ratio_m
                continue
            out = kernel_step(cfg.sampler.kernel, x[pos[md]], v[pos[md]], s_d[md], s_next_d[md], noise_level=lv,
                              sigma_at_one=sigma_at_one, prev_sample=prev[md], reduce=cfg.train.log_prob_reduce,
                              **options)
            logp[md] = out.log_prob
            if self.divergence_std is not None:
                mean_old = tree.gather(tree.mean, rnd[m], child[m]).to(dev)
                std = out.std if self.divergence_std == "transition" else None
                divergence[md] = losses.transition_divergence(out.mean.detach(), mean_old, std)
            if self.guard:  # the normalised log-ratio, carried as old + (logp - old + bias) * s
                mean_old = tree.gather(tree.mean, rnd[m], child[m]).to(dev)
                logp[md] = old_d[md] + guard_log_ratio(out.log_prob, old_d[md], out.mean, mean_old, out.std)
            if v_ref is not None:
                kl[md] = kl_to_reference(cfg, out, x[pos[md]], v_ref[pos[md]], s_d[md], s_next_d[md], prev[md], lv,
                                         sigma_at_one, options)
        step_index = parent_index[pos_host]
        return EdgeTerms(logp, old_d, adv, kl, step_index, divergence), loss_and_ratio

    def _untrained_kl(self, rounds: torch.Tensor, child: torch.Tensor) -> torch.Tensor:
        """Per state (K,): the KL between the trained and the reference policy's full-rank SDE transitions at
        sampler.noise_level from the parents of the given untrained edges (train.kl_untrained_beta)."""
        cfg, tree, dev = self.cfg, self.batch.tree, self.parts.device
        parent = tree.gather(tree.parent, rounds, child)
        x = tree.gather(tree.latents, rounds - 1, parent).to(dev)  # (K, *latent)
        s = to_device(tree.sigmas[tree.gather(tree.index, rounds - 1, parent)], dev)
        s_next = to_device(tree.sigmas[tree.gather(tree.index, rounds, child)], dev)
        rows = to_device(tree.gather(tree.group, rounds - 1, parent), dev)
        v, v_ref = self.velocities(x, s, rows, True)  # (K, *latent) each
        nxt = tree.gather(tree.latents, rounds, child).to(dev)  # scored only because the kernel asks for a sample
        level, sigma_at_one = cfg.sampler.noise_level, float(tree.sigmas[1])
        out = kernel_step(cfg.sampler.kernel, x, v, s, s_next, noise_level=level, sigma_at_one=sigma_at_one,
                          prev_sample=nxt)
        return kl_to_reference(cfg, out, x, v_ref, s, s_next, nxt, level, sigma_at_one, {})  # full rank: no options


def gathered(procs, *rows: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Each list of per-micro-batch rows, gathered over the processes and concatenated (empty lists allowed)."""
    return tuple(torch.cat(x) for x in procs.gather_rows(*(r or [torch.zeros(0)] for r in rows)))


def untrained_states(tree) -> tuple[torch.Tensor, torch.Tensor]:
    """(round, position) of every child node whose edge the plan leaves untrained (an ODE step of the rollout):
    its parent is the state, the child's grid index the step's end. (K,), (K,)."""
    rounds, pos = [], []
    for r in range(1, tree.num_rounds + 1):
        p = torch.nonzero(~tree.trained[r]).flatten()
        rounds.append(torch.full_like(p, r))
        pos.append(p)
    return torch.cat(rounds), torch.cat(pos)


def kl_to_reference(cfg, out, x, v_ref, s, s_next, prev, noise_level: float, sigma_at_one: float,
                    options: dict) -> torch.Tensor:
    """Per transition (N,): the Gaussian KL between the policy's step ``out`` (kernel_step's result from x) and
    the reference's step with velocity v_ref, over the same std (train.kl_std)."""
    dev = out.mean.device
    ref = kernel_step(cfg.sampler.kernel, x, v_ref, s, s_next, noise_level=noise_level, sigma_at_one=sigma_at_one,
                      prev_sample=prev, **options)
    std = kl_std(cfg.train.kl_std, out.std, s.to(dev), s_next.to(dev))
    return gaussian_kl_same_std(out.mean, ref.mean, std)


class ForwardProcessObjective(Objective):
    """Training on the forward process: every clean leaf x0 is re-noised at the algorithm's timesteps t
    (``x_t = (1 - t) x0 + t eps``) and the algorithm's per-sample loss (``forward_process_loss``) is minimised,
    with the old policy's velocity beside the trained one's, plus ``train.kl_beta`` x mean((v - v_ref)^2)."""

    trains_transitions = False  # the plan's trained edges do not enter the loss (its rollout may be all ODE)

    def __init__(self, algorithm, parts: TrainingParts):
        self.algorithm, self.parts, self.cfg = algorithm, parts, algorithm.cfg

    def work_items(self, batch: UpdateBatch, gen: torch.Generator) -> list:
        cfg, tree, dev = self.cfg, batch.tree, self.parts.device
        self.cond = batch.cond
        self.x0 = tree.leaves.to(dev)  # (L, *latent) clean samples
        self.adv = tree.leaf_values(batch.node_adv).float().clamp(-cfg.advantage.clip, cfg.advantage.clip)  # (L,)
        self.prompt_rows = tree.leaf_group
        self.t = self.algorithm.training_timesteps(self.x0.shape[0], self.parts.sigmas, gen)  # (L, k) sigmas
        self.losses, self.kls, self.gaps, self.nfe = [], [], [], 0
        return [(i, j) for i in range(self.t.shape[0]) for j in range(self.t.shape[1])]

    def item_size(self, item) -> int:
        return 1

    def item_rows(self, item) -> int:
        return 1

    def begin_minibatch(self, items: list, gen: torch.Generator) -> None:
        # the whole minibatch's re-noising draws, on every process, so an item's noise is its own
        self.eps = torch.randn((len(items), *self.x0.shape[1:]), generator=gen)  # (M, *latent)

    def micro_batch_loss(self, numbered: list[tuple[int, Any]], record: bool = True) -> torch.Tensor:
        cfg, parts, policy = self.cfg, self.parts, self.parts.policy
        dev, adapter, autocast = parts.device, parts.adapter, parts.accelerator.autocast
        li = torch.tensor([i for _, (i, _) in numbered])
        t = self.t[li, torch.tensor([j for _, (_, j) in numbered])].to(dev)  # (B,)
        x0 = self.x0[li.to(dev)]
        eps = self.eps[[n for n, _ in numbered]].to(dev)  # (B, *latent)
        tt = t.view(-1, *([1] * (x0.ndim - 1)))
        x_t = (1 - tt) * x0 + tt * eps  # (B, *latent) on the forward process
        rows = self.cond.index(self.prompt_rows[li].to(self.cond.embeds.device))
        with torch.no_grad(), autocast():  # before v: the swaps are in place
            v_old = None
            if self.algorithm.keeps_old_policy:  # DiffusionNFT compares with the old policy; AWM needs no old velocity
                with policy.old_weights():
                    v_old = adapter.velocity(x_t, t, rows)
            v_ref = None
            if cfg.train.kl_beta > 0:
                with policy.reference():
                    v_ref = adapter.velocity(x_t, t, rows)
        with autocast():
            v = adapter.velocity(x_t, t, rows)
        dims = tuple(range(1, x0.ndim))
        loss = self.algorithm.forward_process_loss(x0, x_t, t, v, v_old, self.adv[li].to(dev))  # (B,)
        kl = ((v - v_ref) ** 2).mean(dim=dims) if v_ref is not None else torch.zeros_like(loss)
        if not record:
            return (loss + cfg.train.kl_beta * kl).sum()
        self.nfe += len(numbered)
        self.losses.append(loss.detach())
        self.kls.append(kl.detach())
        if v_old is not None:
            self.gaps.append(((v.detach() - v_old) ** 2).mean(dim=dims))
        return (loss + cfg.train.kl_beta * kl).sum()

    def end_minibatch(self, gen: torch.Generator) -> torch.Tensor | None:
        return None

    def statistics(self) -> dict:
        procs = self.parts.procs
        losses, kls = procs.gather_rows(self.losses, self.kls)
        # no ratio: the loss is the weighted matching error itself (no clip, no old log-probs)
        stats = {"trained_edges": 0, "work_items": self.t.numel(), "nfe_train": procs.sum(self.nfe),
                 "policy_loss": float(torch.cat(losses).mean()), "kl_loss": float(torch.cat(kls).mean())}
        if self.algorithm.keeps_old_policy:  # the same on every process, so the gather stays collective
            gaps, = procs.gather_rows(self.gaps)
            stats["old_policy_gap"] = float(torch.cat(gaps).mean())  # mean (v - v_old)^2: how far the old lags
        return stats


