"""Online Diffusion-DPO for flow models (Diffusion-DPO, arXiv 2311.12908, on the policy's own samples): in each
prompt's group the best sample is the chosen one and the worst the rejected one; both are re-noised with the same
noise at the same sigma, and with ``Delta(x) = e_theta(x) - e_ref(x)`` the difference of the flow-matching errors
``e = mean((v - (eps - x0))^2)`` of the policy and the reference (the LoRA-disabled model),

    L = -log sigmoid(-(beta / 2) (Delta(x_w) - Delta(x_l))),

which lowers the policy's error on the chosen sample relative to the reference more than on the rejected one. A group
whose rewards are all equal has no pair and is skipped (the published script then pairs samples 1 and 0). ``beta``
(``dpo_beta``) is on per-element-mean errors, as every peer computes them (100 in Flow-GRPO's script)."""

from __future__ import annotations

from typing import Any

import torch

from .. import losses
from ..config import opt
from ..errors import ConfigError
from ..objectives import ForwardProcessObjective, UpdateBatch
from .forward_process import ForwardProcessAlgorithm, StrataOptions


class OnlineDPOOptions(StrataOptions):
    dpo_beta: float = opt(100.0, "DPO's inverse temperature on per-element-mean errors (Flow-GRPO's script: 100)",
                      lo=0.0, lo_open=True)
    timesteps_per_sample: int = opt(2, "(sigma, noise) draws per pair", lo=1)
    time_type: str = opt("logit_normal", "the training sigmas: logit_normal as Flow-GRPO's DPO script (continuous, on "
                         "the training scheduler's timesteps), or AWM's grid strata (discrete_wo_init, discrete)",
                         choices=["logit_normal", "discrete_wo_init", "discrete"])


def preference_pairs(rewards: torch.Tensor, groups: torch.Tensor) -> list[tuple[int, int]]:
    """(chosen, rejected) leaf indices per group: the first highest and the first lowest finite reward; groups whose
    finite rewards are all equal (or fewer than two) have none."""
    pairs = []
    for g in groups.unique().tolist():
        idx = ((groups == g) & torch.isfinite(rewards)).nonzero().flatten()
        if len(idx) < 2:
            continue
        r = rewards[idx]
        if float(r.max()) > float(r.min()):
            pairs.append((int(idx[int(torch.argmax(r))]), int(idx[int(torch.argmin(r))])))
    return pairs


class OnlineDPO(ForwardProcessAlgorithm):
    Options = OnlineDPOOptions

    @classmethod
    def check(cls, cfg) -> None:
        if not cfg.train.lora.enabled:
            raise ConfigError("train.lora.enabled: online_dpo compares the policy with the LoRA-disabled model; "
                              "set train.lora.enabled=true")

    def advantages(self, tree, rewards: torch.Tensor, it: int, prompts: list[str] | None = None):
        """No advantages (zeros): the update reads the pairs (:meth:`preference_pairs`), not advantages."""
        keep = [torch.ones(x.shape[0], dtype=torch.bool) for x in tree.latents]
        zeros = tree.node_values_from_leaves(torch.zeros(rewards.shape[0]))
        return zeros, keep, {"dpo_pairs": len(preference_pairs(rewards, tree.leaf_group))}

    def preference_pairs(self, tree, scores) -> list[tuple[int, int]]:
        """Each group's (best, worst) leaves by the total reward: the update batch's ``pairs``."""
        return preference_pairs(scores.total, tree.leaf_group)

    def make_objective(self, parts):
        """The pairwise objective (:class:`PreferencePairObjective`, below)."""

        return PreferencePairObjective(self, parts)


class PreferencePairObjective(ForwardProcessObjective):
    """Online Diffusion-DPO on the forward process: each work item is a (chosen, rejected) pair of clean samples at
    one training sigma, both re-noised with the same noise; the loss per pair is the algorithm's ``dpo_loss`` of the
    policy's and the reference's flow-matching errors. Logs ``dpo_accuracy`` (pairs whose chosen sample the policy
    already prefers relative to the reference) and ``dpo_pairs``."""

    def work_items(self, batch: UpdateBatch, gen: torch.Generator) -> list:
        tree, dev = batch.tree, self.parts.device
        self.cond = batch.cond
        self.x0 = tree.leaves.to(dev)  # (L, *latent)
        self.prompt_rows = tree.leaf_group
        self.pairs = list(batch.pairs or [])  # (chosen, rejected) leaves, one pair per group that has one
        self.t = self.algorithm.training_timesteps(len(self.pairs), self.parts.sigmas, gen)  # (P, k)
        self.losses, self.wins, self.nfe = [], [], 0
        return [(p, j) for p in range(len(self.pairs)) for j in range(self.t.shape[1])]

    def item_size(self, item) -> int:
        return 2  # two samples through the policy (and two through the reference)

    def micro_batch_loss(self, numbered: list[tuple[int, Any]], record: bool = True) -> torch.Tensor:
        parts, policy, dev = self.parts, self.parts.policy, self.parts.device
        adapter, autocast = parts.adapter, parts.accelerator.autocast
        p_idx = torch.tensor([p for _, (p, _) in numbered])
        t = self.t[p_idx, torch.tensor([j for _, (_, j) in numbered])].to(dev)  # (B,)
        leaves = torch.tensor([[self.pairs[p][0], self.pairs[p][1]] for p in p_idx.tolist()])  # (B, 2)
        x0 = self.x0[leaves.flatten().to(dev)]  # (2B, *latent): chosen, rejected, chosen, ...
        eps = self.eps[[n for n, _ in numbered]].to(dev).repeat_interleave(2, dim=0)  # the same noise for a pair
        t2 = t.repeat_interleave(2)
        tt = t2.view(-1, *([1] * (x0.ndim - 1)))
        x_t = (1 - tt) * x0 + tt * eps
        rows = self.cond.index(self.prompt_rows[leaves.flatten()].to(self.cond.embeds.device))
        with torch.no_grad(), autocast(), policy.reference():
            v_ref = adapter.velocity(x_t, t2, rows)
        with autocast():
            v = adapter.velocity(x_t, t2, rows)
        target = eps - x0
        err = ((v.float() - target) ** 2).flatten(1).mean(1).view(-1, 2)  # (B, 2) chosen, rejected
        err_ref = ((v_ref.float() - target) ** 2).flatten(1).mean(1).view(-1, 2)
        loss = losses.dpo_loss(err[:, 0], err_ref[:, 0], err[:, 1], err_ref[:, 1], self.algorithm.opts.dpo_beta)  # (B,)
        if not record:
            return loss.sum()
        self.nfe += 2 * len(numbered)
        self.losses.append(loss.detach())
        self.wins.append((((err[:, 0] - err_ref[:, 0]) - (err[:, 1] - err_ref[:, 1])) < 0).float().detach())
        return loss.sum()

    def statistics(self) -> dict:
        procs = self.parts.procs
        losses, wins = procs.gather_rows(self.losses or [torch.zeros(0)], self.wins or [torch.zeros(0)])
        losses, wins = torch.cat(losses), torch.cat(wins)
        return {"trained_edges": 0, "work_items": self.t.numel(), "nfe_train": procs.sum(self.nfe),
                "policy_loss": float(losses.mean()) if len(losses) else 0.0,
                "dpo_accuracy": float(wins.mean()) if len(wins) else 0.0}
