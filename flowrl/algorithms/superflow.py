"""SuperFlow (arXiv 2512.17951; no public code): a per-prompt Beta tracker of the reward (SPO's) decides which
prompts are rolled out (probability ∝ sqrt(v (1 - v))) and how many samples each gets (priority bins between
min_group and max_group); advantages are r - v_hat(prompt) z-scored over the batch, and the step-level
advantage eta * sigma_t * A is a per-step loss weight. The binning, group-size mapping and KL-adaptive
forgetting are assumptions documented in flowrl/trackers.py."""

from __future__ import annotations


import torch
from pydantic import Field

from ..config import AlgorithmOptions, opt
from ..errors import ConfigError
from ..samplers.kernels import flow_grpo_noise_scale
from ..trackers import BetaTracker, superflow_advantages, superflow_group_sizes
from .base import WindowOptions
from .transition import TransitionAlgorithm


class SuperFlowOptions(AlgorithmOptions):
    timestep_fraction: float = opt(0.99, "the first int(T * f) steps are trained (without a window)", lo=0.0, hi=1.0,
                                   lo_open=True)
    window: WindowOptions = Field(default_factory=WindowOptions)
    rho: float = opt(0.9, "tracker forgetting factor per visit", lo=0.0, hi=1.0)
    rho_mode: str = opt("constant", "constant rho, or SPO's KL-adaptive clip(2^(-D/d_half), rho_min, 0.96) with D "
                        "the last update's mean |log-prob change|", choices=["constant", "kl_adaptive"])
    d_half: float = opt(0.06, "KL-adaptive rho: the divergence at which rho halves", lo=0.0, lo_open=True)
    rho_min: float = opt(0.5, "KL-adaptive rho: its lower bound", lo=0.0, hi=1.0)
    reward_range: list[float] = opt([0.0, 1.0], "rewards are mapped linearly from this range to [0, 1] and clamped")
    min_group: int = opt(4, "group size of the most certain prompts", lo=2)
    max_group: int = opt(8, "group size of the most uncertain prompts", lo=2)
    bins: int = opt(4, "priority bins between min_group and max_group", lo=1)
    step_eta: float = opt(1.0, "step-level advantage eta * sigma_t * A (0 = off)", lo=0.0)
    loss_weight: str = opt("sigma_t", "sigma_t: the step-level advantage as a per-step loss weight; none",
                           choices=["sigma_t", "none"])


class SuperFlow(TransitionAlgorithm):
    Options = SuperFlowOptions

    @classmethod
    def check(cls, cfg) -> None:
        o = cfg.algorithm
        if o.min_group > o.max_group:
            raise ConfigError(f"algorithm.min_group ({o.min_group}) must not exceed max_group ({o.max_group})")
        if len(o.reward_range) != 2 or o.reward_range[1] <= o.reward_range[0]:
            raise ConfigError(f"algorithm.reward_range {o.reward_range} must be [low, high] with low < high")
        if cfg.advantage.combine == "per_reward":
            raise ConfigError("advantage.combine=per_reward: superflow's prompt tracker follows the summed reward; "
                              "use advantage.combine=sum")

    def __init__(self, cfg):
        super().__init__(cfg)
        o = self.opts
        self.tracker = BetaTracker(o.rho, reward_range=tuple(o.reward_range), rho_mode=o.rho_mode, d_half=o.d_half,
                                   rho_min=o.rho_min)

    def group(self) -> tuple[int, bool]:
        return self.opts.max_group, False  # the plan's count; each prompt's own size comes from choose_prompts

    def choose_prompts(self, ctx, it, gen, row):
        """Prompts drawn without replacement with probability ∝ the tracker's priority; group size by its bin."""
        pool, o = ctx.prompts, self.opts
        w = torch.tensor([self.tracker.priority(p) for p in pool.prompts], dtype=torch.float64)
        idx = torch.multinomial(w, min(self.cfg.train.prompts_per_iter, len(w)), replacement=False,
                                generator=gen).tolist()
        prompts, metadata = [pool.prompts[i] for i in idx], [pool.metadata[i] for i in idx]
        roots = superflow_group_sizes([self.tracker.priority(p) for p in prompts], o.min_group, o.max_group, o.bins)
        row["group_size_mean"] = sum(roots) / len(roots)
        return prompts, metadata, roots

    def leaf_advantages(self, tree, rewards, baselines):
        _, stats = super().leaf_advantages(tree, rewards, baselines)  # group statistics, for logging
        adv = self.cfg.advantage
        return superflow_advantages(rewards, baselines, adv.eps).clamp(-adv.clip, adv.clip), stats

    def loss_weights(self, tree, masks) -> dict[int, float] | None:
        """eta * sigma_t per step (the PPO-clip loss is linear in a positive scale of A)."""
        if self.opts.loss_weight != "sigma_t":
            return None
        a, eta, s1 = self.cfg.sampler.noise_level, self.opts.step_eta, float(tree.sigmas[1])
        return {i: eta * flow_grpo_noise_scale(float(tree.sigmas[i]), s1, a) if eta > 0 else 1.0
                for i in range(tree.num_steps)}
