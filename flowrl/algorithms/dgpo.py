"""DGPO, Direct Group Preference Optimization (arXiv 2510.08425): a group-level DPO on the forward process. G
deterministic (ODE) samples per prompt are scored and group z-scored (A_i). Each training sigma re-noises the whole
group with one shared noise, and with ``e_i`` the policy's and ``e_ref_i`` the reference's flow-matching error
``mean((v - (eps - x0_i))^2)``, the detached group score ``S = (beta_dpo / G) sum_i A_i (e_i - e_ref_i)`` weights
each sample's term:

    L = mean_i sigmoid(S) A_i e_i  (+ train.kl_beta mean((v_theta - v_ref)^2)),

whose gradient is the group preference ``-log sigmoid(-S)``'s up to beta_dpo / G (:func:`flowrl.losses.
group_preference_loss`). A sample whose denoising ratio ``rho = exp(e_old - e)`` against a fast EMA of the weights
has already moved past ``1 +- clip_range`` in its advantage's direction enters detached (:func:`flowrl.losses.
dsm_clip`). The EMA follows the trained weights after every iteration with decay min(0.3, 0.001 it) from
iteration ``switch_ema_ref`` (and rollouts are drawn with it from then); before that it equals the weights the
iteration started with. Training sigmas: ``timesteps_per_sample`` grid indices drawn without replacement from the
first ``trunc_steps``, the same for the whole iteration. Defaults from the official code (SD3.5-M; beta_dpo 100,
clip 0.01, 6 steps, 4 sigmas); its all-reduce of S across processes is not needed here, since a group is one work
item on one process."""

from __future__ import annotations

import torch

from ..config import opt
from .base import GroupOptions
from .diffusion_nft import DiffusionNFT


class DGPOOptions(GroupOptions):
    dpo_beta: float = opt(100.0, "beta_dpo: the group score's inverse temperature on per-element-mean errors (the "
                          "code: 100; 10 for PickScore)", lo=0.0, lo_open=True)
    timesteps_per_sample: int = opt(4, "training sigmas per iteration (grid indices drawn without replacement)",
                                    lo=1)
    trunc_steps: int = opt(6, "the training sigmas come from the first trunc_steps grid indices (the code: 6; 4 "
                           "for GenEval)", lo=1)
    clip_range: float = opt(0.01, "c of the denoising-ratio clip against the fast EMA", lo=0.0, lo_open=True)
    switch_ema_ref: int = opt(200, "iteration from which the fast EMA lags the weights (decay min(0.3, 0.001 it)) "
                              "and draws the rollouts", lo=0)


class DGPO(DiffusionNFT):
    Options = DGPOOptions
    keeps_old_policy = True  # the fast EMA: the denoising ratio's old errors, and the rollouts after the switch
    refuses_grpo_guard = "dgpo has no transition ratios to normalise"

    @classmethod
    def check(cls, cfg) -> None:
        super().check(cfg)
        if not cfg.train.lora.enabled and cfg.train.kl_beta <= 0:
            from ..errors import ConfigError

            raise ConfigError("train.kl_beta: dgpo compares the policy with the starting weights, which full "
                              "fine-tuning keeps only with a KL; set train.kl_beta > 0 (the code: 0.001-0.02) or "
                              "train.lora.enabled=true")

    def training_timesteps(self, n: int, sigmas: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """(n, k) sigmas: k grid indices from the first trunc_steps, without replacement, shared by every sample."""
        pool = min(self.opts.trunc_steps, len(sigmas) - 1)
        idx = torch.randperm(pool, generator=gen)[: min(self.opts.timesteps_per_sample, pool)]
        return sigmas[idx].unsqueeze(0).expand(n, -1)

    def make_objective(self, parts):
        """The group objective (:class:`flowrl.objectives.GroupPreferenceObjective`)."""
        from ..objectives import GroupPreferenceObjective

        return GroupPreferenceObjective(self, parts)

    def old_decay(self, it: int) -> float:
        return 0.0 if it < self.opts.switch_ema_ref else min(0.3, 0.001 * it)
