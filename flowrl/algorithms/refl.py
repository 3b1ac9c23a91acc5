"""Direct reward backpropagation, in two modes (DRaFT, arXiv 2309.17400; ImageReward's ReFL, arXiv 2304.05977): no
advantages and no log-probs. Each prompt's samples are drawn by the deterministic (ODE) sampler.

``mode: draft_k`` (the default), DRaFT-K: the update re-runs the last ``grad_steps`` (K) steps from the stored state
with the policy's graph kept, decodes, and follows the gradient of a differentiable reward:

    L = -mean r(decode(x_T))  (+ train.kl_beta mean((v_theta - v_ref)^2) over the K steps).

(DRaFT-LV is K = 1 plus re-noising the final sample several times, which this mode does not do.)

``mode: refl``, ImageReward's ReFL: each sample stops at a step t drawn uniformly from the last
``refl_window`` of the grid (30..39 of 40 for 0.25), the policy predicts the clean image from that state in one
step, ``x0 = x_t - sigma_t v_theta(x_t)``, and the loss is ``refl_scale relu(refl_margin - r(decode(x0)))`` (ReFL's
``relu(2 - r)`` scaled by 1e-3).

The reward must pass a gradient to the images (the ``clip`` reward, or a function marked ``differentiable =
True``); any other is refused before a model loads. DRaFT-K's defaults: K = 1, one sample per prompt."""

from __future__ import annotations

import random
from typing import Any

import torch

from ..config import AlgorithmOptions, opt
from ..errors import ConfigError, RewardError
from ..objectives import Objective, TrainingParts, UpdateBatch, gathered, velocities
from ..samplers import RolloutPlan, StepSpec
from .base import Algorithm


class ReFLOptions(AlgorithmOptions):
    samples_per_prompt: int = opt(1, "ODE samples per prompt", lo=1)
    mode: str = opt("draft_k", "draft_k: re-run the last K steps with the graph and differentiate the final image's "
                    "reward (DRaFT-K); refl: one x0 prediction from a random late step, loss relu(margin - r) (ReFL)",
                    choices=["draft_k", "refl"])
    grad_steps: int = opt(1, "draft_k: K, the last K sampling steps re-run with the graph kept", lo=1)
    refl_window: float = opt(0.25, "refl: the stop step is drawn from the last fraction of the grid (ReFL: 30..39 "
                             "of 40)", lo=0.0, lo_open=True, hi=1.0)
    refl_margin: float = opt(2.0, "refl: the loss is relu(margin - reward) (ReFL: 2 on ImageReward's scale)")
    refl_scale: float = opt(1e-3, "refl: the loss's scale (ReFL's grad_scale)", lo=0.0, lo_open=True)


class ReFL(Algorithm):
    Options = ReFLOptions
    refuses_grpo_guard = "refl has no transition ratios to normalise"

    @classmethod
    def check(cls, cfg) -> None:
        if cfg.algorithm.grad_steps > cfg.sampler.num_steps:
            raise ConfigError(f"algorithm.grad_steps={cfg.algorithm.grad_steps}: at most sampler.num_steps="
                              f"{cfg.sampler.num_steps} steps can be re-run")
        if cfg.train.kl_untrained_beta > 0:
            raise ConfigError("train.kl_untrained_beta: refl trains no transitions; set train.kl_untrained_beta=0")

    def check_inputs(self, rewards, prompts=None) -> None:
        bad = rewards.not_differentiable()
        if bad:
            raise RewardError(f"rewards: refl follows the reward's gradient, and {', '.join(bad)} passes none to the "
                              f"images; use clip (preprocess tensor_bilinear) or a function marked differentiable = True")

    def plan(self, it: int, rng: random.Random | None = None, sigmas: torch.Tensor | None = None) -> RolloutPlan:
        """Every step ODE, none a trained transition (the update re-runs the last K itself)."""
        return RolloutPlan([StepSpec(sde=False) for _ in range(self.cfg.sampler.num_steps)],
                           roots_per_prompt=self.opts.samples_per_prompt)

    def advantages(self, tree, rewards, it, prompts=None):
        """None: the reward itself is differentiated."""
        zeros = [torch.zeros(x.shape[0]) for x in tree.latents]
        return zeros, [torch.ones(x.shape[0], dtype=torch.bool) for x in tree.latents], {}

    def select_edges(self, tree, gen):
        return [torch.zeros(x.shape[0], dtype=torch.bool) for x in tree.latents]

    @property
    def predicts_x0(self) -> bool:
        """ReFL's one-step prediction of the clean image (``mode: refl``), not DRaFT-K's re-run of the last K steps."""
        return self.opts.mode == "refl"

    def make_objective(self, parts):

        return RewardBackpropObjective(self, parts)


class RewardBackpropObjective(Objective):
    """Reward backpropagation: each work item is one sample. DRaFT-K (``algorithm.mode=draft_k``): its last
    ``algorithm.grad_steps`` ODE steps are re-run from the rollout's stored state with the policy's graph, the result
    is decoded with its graph, and the loss row is minus the differentiable reward (plus ``train.kl_beta`` x the
    velocity MSE to the reference over the re-run steps); it logs the re-run's gap to the rollout's final latents
    (``refl_rerun_gap``, 0 on the first update). ReFL (``mode=refl``): from the stored state at the sample's drawn
    stop step, one prediction ``x0 = x_t - sigma v`` is decoded and the row is ``refl_scale relu(refl_margin - r)``.
    Both log ``reward_grad_mean``, the reward the update differentiated."""

    trains_transitions = False

    def __init__(self, algorithm, parts: TrainingParts):
        self.algorithm, self.parts, self.cfg = algorithm, parts, algorithm.cfg

    def work_items(self, batch: UpdateBatch, gen: torch.Generator) -> list:
        tree = self.tree = batch.tree
        self.cond = batch.cond
        self.prompts, self.metadata = batch.prompts, batch.metadata
        opts, n_rounds = self.algorithm.opts, tree.num_rounds
        rounds, pos = tree.leaf_positions()
        if self.algorithm.predicts_x0:  # each sample's stop step, uniform over the grid's last refl_window
            first = min(n_rounds - 1, int(n_rounds * (1 - opts.refl_window)))
            stops = torch.randint(first, n_rounds, (len(pos),), generator=gen)  # (L,) grid indices
        else:  # a chain: round r holds the state at grid index r; the re-run starts K rounds up
            stops = torch.full((len(pos),), n_rounds - opts.grad_steps)
        # each leaf's ancestor at its stop round, following the parents up
        anc, start = pos.clone(), torch.empty_like(tree.leaves)
        for r in range(n_rounds, int(stops.min()) - 1, -1):
            at = stops == r
            start[at] = tree.latents[r][anc[at]]
            if r > 0:
                anc = tree.parent[r][anc]
        self.start, self.stops = start, stops  # (L, *latent), (L,)
        self.start_index = n_rounds - opts.grad_steps
        self.final = tree.leaves
        self.rows = tree.leaf_group
        self.rewards_seen, self.gaps, self.kls, self.nfe, self.first, self.first_gap = [], [], [], 0, True, 0.0
        self.losses = []
        return list(range(len(anc)))

    def item_size(self, item) -> int:
        return 1

    def item_rows(self, item) -> int:
        return 1

    def begin_minibatch(self, items: list, gen: torch.Generator) -> None:
        pass

    def micro_batch_loss(self, numbered: list[tuple[int, Any]], record: bool = True) -> torch.Tensor:
        from ..models.base import decode_with_grad

        cfg, parts, dev = self.cfg, self.parts, self.parts.device
        leaves = torch.tensor([i for _, i in numbered])
        x = self.start[leaves].to(dev)  # (B, *latent)
        rows = self.rows[leaves]
        cond = self.cond.index(rows.to(self.cond.embeds.device))
        sig = self.tree.sigmas.to(dev)
        if self.algorithm.predicts_x0:
            return self._refl_loss(x, sig[self.stops[leaves].to(dev)], cond, rows, record)
        kl = torch.zeros(len(leaves), device=dev)
        for i in range(self.start_index, len(sig) - 1):
            s = sig[i].expand(len(leaves))
            v, v_ref = velocities(parts, x, s, cond, cfg.train.kl_beta > 0)
            if v_ref is not None:
                kl = kl + ((v.float() - v_ref.float()) ** 2).flatten(1).mean(1) / self.algorithm.opts.grad_steps
            x = x + (sig[i + 1] - sig[i]) * v.float()  # the ODE (Euler) step, as the rollout took it
        with parts.accelerator.autocast():
            images = decode_with_grad(parts.adapter, x)
        prompts = [self.prompts[int(g)] for g in rows]
        metadata = [self.metadata[int(g)] for g in rows] if self.metadata else None
        reward = self.parts.rewards.differentiable_total(images, prompts, metadata).to(dev)  # (B,)
        loss = -reward + cfg.train.kl_beta * kl
        if record:
            self.nfe += len(leaves) * self.algorithm.opts.grad_steps
            self.rewards_seen.append(reward.detach().cpu())
            gap = (x.detach().cpu() - self.final[leaves]).abs().flatten(1).max(1).values
            self.gaps.append(gap)
            self.kls.append(kl.detach().cpu())
            if self.first:
                self.first_gap = max(self.first_gap, float(gap.max()))
        return loss.sum()

    def _refl_loss(self, x, sigma, cond, rows, record: bool) -> torch.Tensor:
        """ReFL's rows: x (B, *latent) the states at the stop steps, sigma (B,) theirs."""
        from ..models.base import decode_with_grad

        cfg, parts, opts = self.cfg, self.parts, self.algorithm.opts
        v, v_ref = velocities(parts, x, sigma, cond, cfg.train.kl_beta > 0)
        x0 = x - sigma.view(-1, *([1] * (x.ndim - 1))) * v.float()  # the one-step prediction of the clean latent
        with parts.accelerator.autocast():
            images = decode_with_grad(parts.adapter, x0)
        prompts = [self.prompts[int(g)] for g in rows]
        metadata = [self.metadata[int(g)] for g in rows] if self.metadata else None
        reward = self.parts.rewards.differentiable_total(images, prompts, metadata).to(x.device)  # (B,)
        kl = ((v.float() - v_ref.float()) ** 2).flatten(1).mean(1) if v_ref is not None else torch.zeros_like(reward)
        loss = opts.refl_scale * torch.relu(opts.refl_margin - reward) + cfg.train.kl_beta * kl
        if record:
            self.nfe += len(rows)
            self.rewards_seen.append(reward.detach().cpu())
            self.kls.append(kl.detach().cpu())
            self.losses.append(loss.detach().cpu())
        return loss.sum()

    def end_minibatch(self, gen: torch.Generator) -> torch.Tensor | None:
        self.first = False
        return None

    def statistics(self) -> dict:
        procs = self.parts.procs
        rewards, gaps, kls = gathered(procs, self.rewards_seen, self.gaps, self.kls)
        stats = {"trained_edges": 0, "work_items": len(self.start), "nfe_train": procs.sum(self.nfe),
                 "kl_loss": float(kls.mean()) if len(kls) else 0.0,
                 "reward_grad_mean": float(rewards.mean()) if len(rewards) else 0.0}
        if self.algorithm.predicts_x0:
            losses, = gathered(procs, self.losses)
            stats["policy_loss"] = float(losses.mean()) if len(losses) else 0.0
        else:  # DRaFT-K's loss is minus the reward; its re-run retraces the rollout on the first update
            stats["policy_loss"] = -float(rewards.mean()) if len(rewards) else 0.0
            stats["refl_rerun_gap"] = max(procs.gather([self.first_gap]))
        return stats
