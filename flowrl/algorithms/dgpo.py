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

import torch

from ..config import opt
from ..errors import ConfigError
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
        """The group objective (:class:`flowrl.objectives.GroupPreferenceObjective`)."""
        from ..objectives import GroupPreferenceObjective

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
