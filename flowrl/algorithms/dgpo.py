"""DGPO, Direct Group Preference Optimization (arXiv 2510.08425): a group-level DPO on the forward process. G
deterministic (ODE) samples per prompt are scored and group z-scored (A_i). Each training sigma re-noises the whole
group with one shared noise, and with ``e_i`` the policy's and ``e_ref_i`` the reference's flow-matching error
``mean((v - (eps - x0_i))^2)``, the detached group score ``S = (beta_dpo / G) sum_i A_i (e_i - e_ref_i)`` weights
each sample's term:

    L = mean_i sigmoid(S) A_i e_i  (+ train.kl_beta mean((v_theta - v_ref)^2)),

whose gradient is the group preference ``-log sigmoid(-S)``'s up to beta_dpo / G (:func:`flowrl.losses.
group_preference_loss`). A sample whose denoising ratio ``rho = exp(e_old - e)`` against a fast EMA of the weights
has already moved past ``1 +- clip_range`` in its advantage's direction enters detached (:func:`flowrl.losses.
dsm_clip`). The EMA follows the trained weights after every optimizer step from the first, with decay
min(0.3, 0.001 s) at step s; the rollouts are drawn with it once more than ``switch_ema_ref`` optimizer steps are done, with
the trained weights before. Training sigmas: ``timesteps_per_sample`` grid indices drawn without replacement from
0..``trunc_steps`` (both included), the same for the whole iteration. Defaults from the official code (SD3.5-M;
beta_dpo 100, clip 0.05, 6 steps, 4 sigmas); its all-reduce of S across processes is not needed here, since a group
is one work item on one process (each training sigma of a group gets its own shared noise). Where ours differs: the
sampler is Euler's ODE (the code's is a DPM-solver)."""

from __future__ import annotations

from typing import Any

import torch

from .. import losses
from ..config import opt
from ..errors import ConfigError
from ..objectives import ForwardProcessObjective, UpdateBatch, gathered
from .base import GroupOptions
from .forward_process import ForwardProcessAlgorithm


class DGPOOptions(GroupOptions):
    dpo_beta: float = opt(100.0, "beta_dpo: the group score's inverse temperature on per-element-mean errors (the "
                          "code: 100; 10 for PickScore)", lo=0.0, lo_open=True)
    timesteps_per_sample: int = opt(4, "training sigmas per iteration (grid indices drawn without replacement)",
                                    lo=1)
    trunc_steps: int = opt(6, "the training sigmas come from the first trunc_steps grid indices (the code: 6; 4 "
                           "for GenEval)", lo=1)
    clip_range: float = opt(0.05, "c of the denoising-ratio clip against the fast EMA (the code: 0.05; 0.01 for "
                            "GenEval and OCR)", lo=0.0, lo_open=True)
    switch_ema_ref: int = opt(200, "the rollouts are drawn with the fast EMA once more than this many optimizer "
                              "steps are done (the code: global_step > 200; 500 for GenEval)", lo=0)


class DGPO(ForwardProcessAlgorithm):
    Options = DGPOOptions
    keeps_old_policy = True  # the fast EMA: the denoising ratio's old errors, and the rollouts after the switch

    @classmethod
    def check(cls, cfg) -> None:
        if not cfg.train.lora.enabled and cfg.train.kl_beta <= 0:
            raise ConfigError("train.kl_beta: dgpo compares the policy with the starting weights, which full "
                              "fine-tuning keeps only with a KL; set train.kl_beta > 0 (the code: 0.001-0.02) or "
                              "train.lora.enabled=true")

    def __init__(self, cfg):
        super().__init__(cfg)
        self.optimizer_steps = 0  # the fast EMA's schedule counts every optimizer step of the run

    def training_timesteps(self, n: int, sigmas: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """(n, k) sigmas: k grid indices from 0..trunc_steps (both included, as the code draws them), without
        replacement, shared by every sample."""
        pool = min(self.opts.trunc_steps + 1, len(sigmas) - 1)
        idx = torch.randperm(pool, generator=gen)[: min(self.opts.timesteps_per_sample, pool)]
        return sigmas[idx].unsqueeze(0).expand(n, -1)

    def make_objective(self, parts):
        """The group objective (:class:`GroupPreferenceObjective`, below)."""

        return GroupPreferenceObjective(self, parts)

    def follow_fast_ema(self, policy) -> None:
        """After every optimizer step from the first: ema <- d ema + (1 - d) weights with d = min(0.3, 0.001 s), s
        the optimizer steps taken before this one."""
        policy.follow_old(min(0.3, 0.001 * self.optimizer_steps))
        self.optimizer_steps += 1

    def old_decay(self, it: int) -> float:
        return 1.0  # the EMA follows every optimizer step (follow_fast_ema), not the iteration

    def samples_with_old_policy(self, it: int) -> bool:
        return self.optimizer_steps > self.opts.switch_ema_ref  # the code: global_step > switch_ema_ref

    def state_dict(self) -> dict:
        return {**super().state_dict(), "optimizer_steps": self.optimizer_steps}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.optimizer_steps = state.get("optimizer_steps", 0)


class GroupPreferenceObjective(ForwardProcessObjective):
    """DGPO on the forward process: each work item is one prompt's group at one training sigma, re-noised with one
    shared noise; the policy, the reference and the old (fast EMA) weights each give the group's flow-matching
    errors, and the rows are :func:`flowrl.losses.group_preference_loss` (with :func:`flowrl.losses.dsm_clip`'s
    samples detached) plus ``train.kl_beta`` x the velocity MSE to the reference. Logs the denoising ratio
    (``ratio_*``, 1 on the first update) and the clipped fraction (``clipfrac``)."""

    def work_items(self, batch: UpdateBatch, gen: torch.Generator) -> list:
        tree, dev, cfg = batch.tree, self.parts.device, self.cfg
        self.cond = batch.cond
        self.x0 = tree.leaves.to(dev)  # (L, *latent)
        self.adv = tree.leaf_values(batch.node_adv).float().clamp(-cfg.advantage.clip, cfg.advantage.clip)  # (L,)
        self.prompt_rows = tree.leaf_group
        self.groups = [(tree.leaf_group == g).nonzero().flatten() for g in tree.leaf_group.unique().tolist()]
        self.t = self.algorithm.training_timesteps(len(self.groups), self.parts.sigmas, gen)  # (P, k)
        self.losses, self.kls, self.ratios, self.clipped, self.first, self.first_dev, self.nfe = [], [], [], [], True, 0.0, 0
        return [(g, j) for g in range(len(self.groups)) for j in range(self.t.shape[1])]

    def after_optimizer_step(self) -> None:
        """The fast EMA follows the weights after every optimizer step (the algorithm's schedule)."""
        self.algorithm.follow_fast_ema(self.parts.policy)

    def item_size(self, item) -> int:
        return len(self.groups[item[0]])

    def item_rows(self, item) -> int:
        return len(self.groups[item[0]])

    def micro_batch_loss(self, numbered: list[tuple[int, Any]], record: bool = True) -> torch.Tensor:
        cfg, parts, policy, dev = self.cfg, self.parts, self.parts.policy, self.parts.device
        adapter, autocast, opts = parts.adapter, parts.accelerator.autocast, self.algorithm.opts
        members = [self.groups[g] for _, (g, _) in numbered]
        leaves = torch.cat(members)  # (B,) every sample of the micro-batch's groups
        sizes = [len(m) for m in members]
        t = torch.cat([self.t[g, j].repeat(len(self.groups[g])) for _, (g, j) in numbered]).to(dev)  # (B,)
        eps = torch.cat([self.eps[n].expand(len(self.groups[g]), *self.eps.shape[1:]) for n, (g, _) in numbered])
        x0 = self.x0[leaves.to(dev)]
        tt = t.view(-1, *([1] * (x0.ndim - 1)))
        eps = eps.to(dev)
        x_t = (1 - tt) * x0 + tt * eps  # (B, *latent): one noise per group
        rows = self.cond.index(self.prompt_rows[leaves].to(self.cond.embeds.device))
        with torch.no_grad(), autocast():
            with policy.reference():
                v_ref = adapter.velocity(x_t, t, rows)
            with policy.old_weights():
                v_old = adapter.velocity(x_t, t, rows)
        with autocast():
            v = adapter.velocity(x_t, t, rows)
        target = eps - x0

        def error(u):
            return ((u.float() - target) ** 2).flatten(1).mean(1)  # (B,)

        err, err_ref, err_old = error(v), error(v_ref), error(v_old)
        adv = self.adv[leaves].to(dev)
        out, clipped = [], []
        for e, er, eo, a in zip(*(x.split(sizes) for x in (err, err_ref, err_old, adv))):
            clip = losses.dsm_clip(e, eo, a, opts.clip_range)
            clipped.append(clip)
            out.append(losses.group_preference_loss(torch.where(clip, e.detach(), e), er, a, opts.dpo_beta))
        loss = torch.cat(out)
        kl = ((v.float() - v_ref.float()) ** 2).flatten(1).mean(1)
        if not record:
            return (loss + cfg.train.kl_beta * kl).sum()
        self.nfe += 3 * len(leaves)
        ratio = torch.exp(err_old - err.detach())
        self.ratios.append(ratio)
        if self.first:
            self.first_dev = max(self.first_dev, float((ratio - 1).abs().max()))
        self.clipped.append(torch.cat(clipped).float())
        self.losses.append(loss.detach())
        self.kls.append(kl.detach())
        return (loss + cfg.train.kl_beta * kl).sum()

    def end_minibatch(self, gen: torch.Generator) -> torch.Tensor | None:
        self.first = False
        return None

    def statistics(self) -> dict:
        procs = self.parts.procs
        losses_, kls, ratios, clipped = gathered(procs, self.losses, self.kls, self.ratios, self.clipped)
        return {"trained_edges": 0, "work_items": self.t.numel(), "nfe_train": procs.sum(self.nfe),
                "clipfrac": float(clipped.mean()) if len(clipped) else 0.0,
                "ratio_mean": float(ratios.mean()) if len(ratios) else 1.0,
                "ratio_std": float(ratios.std(correction=0)) if len(ratios) else 0.0,
                "ratio_max_abs_dev_first_update": max(procs.gather([self.first_dev])),
                "policy_loss": float(losses_.mean()) if len(losses_) else 0.0,
                "kl_loss": float(kls.mean()) if len(kls) else 0.0}
