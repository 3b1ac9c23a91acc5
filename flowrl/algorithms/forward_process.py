"""The forward-process kind: algorithms that never look at the sampler's transitions. The rollout draws G
deterministic (ODE) samples per prompt; the update re-noises each clean sample x0 at training sigmas t,
``x_t = (1 - t) x0 + t eps``, and puts a loss on the policy's velocity there
(:class:`~flowrl.objectives.ForwardProcessObjective` calls :meth:`ForwardProcessAlgorithm.forward_process_loss`
per sample). DiffusionNFT, AWM, DGPO, online DPO, reward-filtered SFT and AC-Flow build on it."""

from __future__ import annotations

import random

import torch

from ..config import opt
from ..errors import ConfigError
from ..objectives import ForwardProcessObjective
from ..samplers import RolloutPlan, StepSpec
from .base import Algorithm, GroupOptions


def stratified_indices(num_steps: int, k: int, gen: torch.Generator, start: int = 1) -> torch.Tensor:
    """(k,) grid indices as AWM's published code draws them: boundaries ``linspace(start, int(0.9 T), k + 1)``
    truncated to integers, then ``lower + floor(u (upper - lower))`` with u uniform in [0, 1) per stratum (the upper
    bound excluded; a stratum of width 0 gives its lower bound)."""
    bounds = torch.linspace(start, int(num_steps * 0.9), k + 1)  # float32, as the code computes them
    lower, upper = bounds[:-1].long(), bounds[1:].long()
    return lower + (torch.rand(k, generator=gen) * (upper - lower)).long()


def logit_normal_sigmas(n: int, k: int, shift: float, gen: torch.Generator, train_timesteps: int = 1000):
    """(n, k) sigmas as Flow-GRPO's DPO and SFT scripts draw them: u = sigmoid(N(0, 1)), the index floor(u N) into
    the training scheduler's N timesteps (N - i at index i), and that timestep's sigma after the family's shift,
    ``shift s / (1 + (shift - 1) s)`` with s = (N - i) / N."""
    u = torch.sigmoid(torch.randn(n, k, generator=gen, dtype=torch.float64))
    index = (u * train_timesteps).long().clamp(max=train_timesteps - 1)
    s = (train_timesteps - index) / train_timesteps
    return (shift * s / (1 + (shift - 1) * s)).float()


class StrataOptions(GroupOptions):
    timesteps_per_sample: int = opt(6, "training sigmas per sample (one per stratum of the rollout grid)", lo=1)
    time_type: str = opt("discrete_wo_init", "the strata of grid indices: discrete_wo_init from index 1 (AWM's code: "
                         "its GenEval and OCR setting), discrete from index 0 (its PickScore setting); both end before "
                         "int(0.9 T)", choices=["discrete_wo_init", "discrete"])


class ForwardProcessAlgorithm(Algorithm):
    """G ODE samples per prompt (none of their transitions trained), each re-noised at :meth:`training_timesteps`
    (by default ``time_type``'s rule, ``timesteps_per_sample`` per sample) and trained with the per-sample
    :meth:`forward_process_loss`."""

    Options = StrataOptions
    refuses_grpo_guard = "a forward-process update has no transition ratios to normalise"
    training_shift = 1.0  # the training scheduler's shift (logit-normal sigmas), set at attach

    @classmethod
    def kind_checks(cls, cfg) -> None:
        name = cfg.algorithm.name
        if cfg.train.kl_untrained_beta > 0:
            raise ConfigError(f"train.kl_untrained_beta: {name} trains on the forward process, where train.kl_beta "
                              "already compares the velocities at every timestep it draws; set "
                              "train.kl_untrained_beta=0")
        if cfg.advantage.zero_variance == "drop_refill":
            raise ConfigError(f"advantage.zero_variance=drop_refill: {name} trains every clean sample (a group of "
                              "equal rewards has no preference among them); use zero_variance=zero")
        if cfg.advantage.combine == "per_reward":
            raise ConfigError(f"advantage.combine=per_reward: {name} reads one advantage per sample; use "
                              "advantage.combine=sum")

    def attach(self, policy, ctx) -> None:
        self.training_shift = float(ctx.sample.adapter.scheduler_config.get("shift", 1.0))

    def plan(self, it: int, rng: random.Random | None = None, sigmas: torch.Tensor | None = None) -> RolloutPlan:
        """G deterministic samples per prompt: every step ODE, none trained (only the clean leaves are used)."""
        t = self.cfg.sampler.num_steps
        return RolloutPlan([StepSpec(sde=False, trained=False) for _ in range(t)], roots_per_prompt=self.opts.group_size)

    def select_edges(self, tree, gen):
        return [torch.zeros(x.shape[0], dtype=torch.bool) for x in tree.latents]

    def training_timesteps(self, n: int, sigmas: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """(n, k) sigmas at which each of n samples is re-noised this update: ``time_type``'s rule with k =
        ``timesteps_per_sample``.

        Args:
            n: samples (or pairs, or groups) re-noised.
            sigmas: the (T + 1,) rollout grid.
            gen: the iteration's generator.
        """
        return self.timesteps_of_type(self.opts.time_type, n, self.opts.timesteps_per_sample, sigmas, gen)

    def timesteps_of_type(self, time_type: str, n: int, k: int, sigmas: torch.Tensor, gen: torch.Generator):
        """(n, k) sigmas by a named rule: ``logit_normal`` (continuous, Flow-GRPO's DPO and SFT scripts) or the grid
        strata of AWM's code (``discrete_wo_init`` from index 1, ``discrete`` from index 0), drawn per sample."""
        if time_type == "logit_normal":
            return logit_normal_sigmas(n, k, self.training_shift, gen)
        start = 1 if time_type == "discrete_wo_init" else 0
        return sigmas[torch.stack([stratified_indices(len(sigmas) - 1, k, gen, start) for _ in range(n)])]

    def make_objective(self, parts):
        """Training on the forward process (:class:`~flowrl.objectives.ForwardProcessObjective`)."""
        return ForwardProcessObjective(self, parts)

    def forward_process_loss(self, x0, x_t, t, v_theta, v_old, adv) -> torch.Tensor:
        """Per-sample loss (B,) of one re-noised micro-batch (the objective adds the KL term).

        Args:
            x0: (B, *latent) the clean samples.
            x_t: (B, *latent) their re-noised states.
            t: (B,) the sigmas.
            v_theta: (B, *latent) the policy's velocity (with its graph).
            v_old: (B, *latent) the old copy's velocity, or None.
            adv: (B,) the samples' advantages.
        """
        raise NotImplementedError(f"{type(self).__name__} must define forward_process_loss()")
