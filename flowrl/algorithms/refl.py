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

import torch

from ..config import AlgorithmOptions, opt
from ..errors import ConfigError, RewardError
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
        from ..objectives import RewardBackpropObjective

        return RewardBackpropObjective(self, parts)
