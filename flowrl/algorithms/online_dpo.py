"""Online Diffusion-DPO for flow models (Diffusion-DPO, arXiv 2311.12908, on the policy's own samples): in each
prompt's group the best sample is the chosen one and the worst the rejected one; both are re-noised with the same
noise at the same sigma, and with ``Delta(x) = e_theta(x) - e_ref(x)`` the difference of the flow-matching errors
``e = mean((v - (eps - x0))^2)`` of the policy and the reference (the LoRA-disabled model),

    L = -log sigmoid(-(beta / 2) (Delta(x_w) - Delta(x_l))),

which lowers the policy's error on the chosen sample relative to the reference more than on the rejected one. A group
whose rewards are all equal has no pair and is skipped (the published script then pairs samples 1 and 0). ``beta``
(``dpo_beta``) is on per-element-mean errors, as every peer computes them (100 in Flow-GRPO's script)."""

from __future__ import annotations

import torch

from ..config import opt
from ..errors import ConfigError
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
        """The pairwise objective (:class:`flowrl.objectives.PreferencePairObjective`)."""
        from ..objectives import PreferencePairObjective

        return PreferencePairObjective(self, parts)
