"""ReFL / DRaFT-K, direct reward backpropagation (ImageReward's ReFL, arXiv 2304.05977; DRaFT, arXiv 2309.17400):
no advantages and no log-probs. Each prompt's samples are drawn by the deterministic (ODE) sampler; the update
re-runs the last ``grad_steps`` (K) steps from the stored state with the policy's graph kept, decodes, and follows
the gradient of a differentiable reward:

    L = -mean r(decode(x_T))  (+ train.kl_beta mean((v_theta - v_ref)^2) over the K steps).

K = 1 is DRaFT-LV's (and UniRL's recipe's) choice. The reward must pass a gradient to the images (the ``clip``
reward, or a function marked ``differentiable = True``); any other is refused before a model loads. Defaults from
UniRL's SD3.5-M recipe: 4 sampling steps, K = 1, one sample per prompt, lr 1e-4, LoRA r 32."""

from __future__ import annotations

import random

import torch

from ..config import AlgorithmOptions, opt
from ..errors import ConfigError, RewardError
from ..samplers import RolloutPlan, StepSpec
from .flow_grpo import FlowGRPO


class ReFLOptions(AlgorithmOptions):
    samples_per_prompt: int = opt(1, "ODE samples per prompt", lo=1)
    grad_steps: int = opt(1, "K: the last K sampling steps are re-run with the graph kept (DRaFT-K)", lo=1)


class ReFL(FlowGRPO):
    Options = ReFLOptions
    refuses_grpo_guard = "refl has no transition ratios to normalise"

    @classmethod
    def check(cls, cfg) -> None:
        cls.check_grpo_guard(cfg)
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

    def attach(self, policy, ctx) -> None:
        self.rewards = ctx.rewards

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

    def make_objective(self, parts):
        from ..objectives import RewardBackpropObjective

        return RewardBackpropObjective(self, parts)
