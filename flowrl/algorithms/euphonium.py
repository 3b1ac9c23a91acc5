"""Euphonium (arXiv 2602.04928): DanceGRPO whose SDE is steered by a process reward's gradient on its last steps,
and whose advantage adds a per-step process term.

**Guided sampling.** On the guided steps (``guidance_start`` to the end) the sample of each transition is moved
along the gradient of the process reward r_p at the current state,

    x' = mu + lambda d g + s z,   g = grad_x r_p(decode(x - sigma v)),   d = sigma - sigma_next,

with v held fixed (the gradient runs through the decoder and the reward, not the transformer), ``lambda =
guidance_scale`` (or ``eta^2 / (2 kl_beta_guidance)`` when that is negative: the KL-regularised optimal-control
reading, 0.01 with the published eta 0.25 and 3.125), and g optionally normalised (``normalize_gradient``: by each
sample's own norm, which is what the published code computes, since its sampler calls the guided step one sample
at a time; or by the whole batch's norm). The stored log-prob is
the *unguided* transition's, as in the official code: the ratio is of the policy itself, so the update pulls the
policy's own mean toward the guided moves, and guidance is what the policy internalises.

**Dual-reward advantages.** The outcome advantage is the group z-score of the outcome rewards (per reward and
summed with their weights, ``advantage.combine=per_reward`` in the presets); on each guided step the process
advantage ``PRA_t`` is the group z-score (torch std + 1e-8) of r_p at that step's states, added with weight
``process_weight`` to the edge's advantage (the code sums two PPO terms, which is the same update while neither
is clipped). The process reward is ``process_reward`` (with ``process_reward_args``) and must pass a gradient to
the images (the ``clip`` reward, or a function marked ``differentiable = True``); any other is refused before a
model loads. With ``process_reward_space: latent`` it is instead a latent reward model of your own,
``fn(latents, sigma, prompts) -> (N,)``, whose gradient is taken at the noisy state directly (the official code's
latent PRM). Defaults from the official HunyuanVideo script: 16 steps, guidance on the last 4, eta 0.25,
lambda 0.01, 60% of the steps trained, group 8."""

from __future__ import annotations

import dataclasses
import random

import torch

from ..config import opt
from ..errors import ConfigError, RewardError
from ..samplers import RolloutPlan
from .dance_grpo import DanceGRPO, DanceGRPOOptions


class EuphoniumOptions(DanceGRPOOptions):
    process_reward: str = opt("clip", "the differentiable process reward r_p (a registered reward or "
                              "module:function)")
    process_reward_args: dict = opt({}, "the process reward's constructor arguments")
    process_reward_space: str = opt("image", "image: the process reward scores the decoded one-step prediction; "
                                    "latent: process_reward is a module:function scoring the noisy latent itself, "
                                    "fn(latents (N, *latent), sigma (N,), prompts) -> (N,) with its graph (a latent "
                                    "reward model)", choices=["image", "latent"])
    guidance_start: int = opt(-1, "first guided step (-1 = the last quarter of the steps; the code: 12 of 16)")
    guidance_scale: float = opt(0.01, "lambda; negative: eta^2 / (2 kl_beta_guidance)")
    kl_beta_guidance: float = opt(3.125, "beta_KL of lambda = eta^2 / (2 beta_KL) (used when guidance_scale < 0)",
                                  lo=0.0, lo_open=True)
    normalize_gradient: str = opt("none", "none (the published script's default); sample: divide g by each sample's "
                                  "own norm (what the published code's normalisation computes: its sampler calls "
                                  "the step one sample at a time); batch: by the whole batch's norm (shrinks as "
                                  "1/sqrt(batch))", choices=["none", "batch", "sample"])
    process_weight: float = opt(1.0, "weight of the process advantage (0 = outcome only, the code's 'none')",
                                lo=0.0)


def process_advantages(values: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """(N,) process rewards of one step, (N,) groups -> (N,) group z-scores with torch's std (+ 1e-8); 0 for a
    group of one."""
    out = torch.zeros(len(values))
    for g in groups.unique().tolist():
        m = groups == g
        if int(m.sum()) > 1:
            v = values[m].double()
            out[m] = ((v - v.mean()) / (v.std() + 1e-8)).float()
    return out


class Euphonium(DanceGRPO):
    """DanceGRPO with reward-gradient guidance on its last SDE steps and a process advantage: a documented variant
    of DanceGRPO."""

    variant_of = DanceGRPO
    Options = EuphoniumOptions

    @classmethod
    def check(cls, cfg) -> None:
        super().check(cfg)
        if cfg.sampler.kernel != "dance":
            raise ConfigError(f"sampler.kernel={cfg.sampler.kernel}: euphonium guides the DanceGRPO SDE; set "
                              f"sampler.kernel=dance")
        if cfg.algorithm.guidance_start >= cfg.sampler.num_steps:
            raise ConfigError(f"algorithm.guidance_start={cfg.algorithm.guidance_start}: no step of "
                              f"sampler.num_steps={cfg.sampler.num_steps} would be guided")

    def check_inputs(self, rewards, prompts=None) -> None:
        from ..config import RewardSpec
        from ..rewards import build_reward_set

        if self.opts.process_reward_space == "latent":
            from ..rewards.registry import build_reward

            if ":" not in self.opts.process_reward:
                raise ConfigError(f"algorithm.process_reward={self.opts.process_reward}: a latent process reward is "
                                  f"a module:function of (latents, sigma, prompts); name one")
            self.latent_reward = build_reward(self.opts.process_reward, **dict(self.opts.process_reward_args))
            return

        self.process = build_reward_set([RewardSpec(name=self.opts.process_reward,
                                                    args=dict(self.opts.process_reward_args))])
        if self.process.not_differentiable():
            raise RewardError(f"algorithm.process_reward={self.opts.process_reward}: euphonium follows its gradient "
                              f"and it passes none to the images; use clip or a function marked differentiable = True")

    def attach(self, policy, ctx) -> None:
        self.adapter = ctx.sample.adapter

    @property
    def first_guided(self) -> int:
        t = self.cfg.sampler.num_steps
        return self.opts.guidance_start if self.opts.guidance_start >= 0 else t - max(1, t // 4)

    @property
    def strength(self) -> float:
        o = self.opts
        return o.guidance_scale if o.guidance_scale >= 0 else self.cfg.sampler.noise_level ** 2 / (2 * o.kl_beta_guidance)

    def plan(self, it: int, rng: random.Random | None = None, sigmas: torch.Tensor | None = None) -> RolloutPlan:
        """DanceGRPO's plan with the steps from ``guidance_start`` guided."""
        base = super().plan(it, rng, sigmas)
        steps = [dataclasses.replace(s, guided=s.sde and i >= self.first_guided) for i, s in enumerate(base.steps)]
        return dataclasses.replace(base, steps=steps, guidance=self.guide)

    def guide(self, x: torch.Tensor, v: torch.Tensor, sigma: float, sigma_next: float, rows: torch.Tensor):
        """(shift (N, *latent), process reward (N,)) at parents x with velocities v (N, *latent)."""
        from ..models.base import decode_with_grad

        prompts = [self.prompts[int(r)] for r in rows]
        metadata = [self.metadata[int(r)] for r in rows] if self.metadata else None
        with torch.enable_grad():
            xg = x.detach().float().requires_grad_(True)
            if self.opts.process_reward_space == "latent":  # a latent reward model scores the noisy state itself
                reward = self.latent_reward(xg, torch.full((len(xg),), sigma, device=xg.device), prompts)
                if not torch.is_tensor(reward) or not reward.requires_grad:
                    raise RewardError(f"algorithm.process_reward={self.opts.process_reward}: it returned no graph "
                                      f"back to the latents; return a tensor computed from them")
            else:
                images = decode_with_grad(self.adapter, xg - sigma * v.detach().float())  # the one-step x0 prediction
                reward = self.process.differentiable_total(images, prompts, metadata)
            (g,) = torch.autograd.grad(reward.sum(), xg)
        if self.opts.normalize_gradient == "sample":
            g = g / g.flatten(1).norm(dim=1).clamp_min(1e-12).view(-1, *([1] * (g.ndim - 1)))
        elif self.opts.normalize_gradient == "batch":
            g = g / g.norm().clamp_min(1e-12)
        return self.strength * (sigma - sigma_next) * g, reward.detach()

    def reward_advantages(self, tree, scores, weights, it, prompts=None):
        """The outcome advantages, plus ``process_weight`` x each guided step's process advantage."""
        node_adv, keep, stats = super().reward_advantages(tree, scores, weights, it, prompts)
        guided = 0
        for r in range(1, tree.num_rounds + 1):
            pr = tree.rounds[r].process_reward
            on = torch.zeros(tree.latents[r].shape[0], dtype=torch.bool)
            if pr is not None:
                parent_index = tree.index[r - 1][tree.parent[r]]
                on = torch.tensor([tree.plan.steps[int(i)].guided for i in parent_index]) & tree.sde[r]
            if bool(on.any()):
                pra = torch.zeros(len(on))
                pra[on] = process_advantages(pr[on], tree.group[r][on])
                node_adv[r] = node_adv[r] + self.opts.process_weight * pra
                stats[f"process_reward/step{int(parent_index[on][0])}"] = float(pr[on].mean())
                guided += int(on.sum())
        stats["guided_edges"] = guided
        return node_adv, keep, stats
