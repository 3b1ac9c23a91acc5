"""Flash-GRPO (arXiv 2605.15980): one stochastic step per rollout. Each prompt draws one step j uniformly from the
first ``int(T * candidate_fraction)`` steps (the same j for every sample of its group: iso-temporal grouping, so
a group's rewards differ only by that step's action); its G samples start from independent noises, run ODE
everywhere but j, and take one SDE step at j, the only trained edge of the trajectory. Advantages are the
terminal rewards less the group's mean over the batch's std (the released ``global_std``).

Temporal gradient rectification: the gradient of the step's log-prob with respect to the velocity is
``-xi * lambda(sigma_j)`` with

    lambda(sigma) = sqrt|dt| / g(sigma) + g(sigma) sqrt|dt| (1 - sigma) / (2 sigma)

for the Flow-SDE drift with diffusion coefficient g (std = g sqrt|dt|), which grows without bound as sigma -> 0.
Each edge's loss is weighted by ``c = 1 / lambda(sigma_j)`` over the mean of c across the batch's trained edges, so
every step's gradient has the same scale. The released sampler's g is linear in sigma (``sampler.kernel=flash``,
g = a sigma_1 sigma); lambda is read from the rollout's own std and grid, so any kernel with this drift (flow_grpo,
dance, flash) gets its own weights.

What the code leaves open is an option here, with its reading: the mean of c is over the iteration's trained edges
(the released code: over the samples of the training batch after those with zero advantage are dropped and some
re-added); the std of the advantage is the batch's (``advantage.std=global``; ``group`` is the per-group variant
the paper's argument suggests).
"""

from __future__ import annotations

import random

import torch

from ..config import opt
from ..errors import ConfigError
from ..samplers import RolloutPlan, StepSpec
from .base import GroupOptions
from .transition import TransitionAlgorithm

# kernels whose mean is Flow-GRPO's drift x (1 + g^2 dt / (2 s)) + v (1 + g^2 (1 - s) / (2 s)) dt, for which
# lambda above is the velocity gradient's scale
SAME_DRIFT = ("flow_grpo", "flash", "dance")


class FlashGRPOOptions(GroupOptions):
    group_size: int = opt(8, "samples per prompt, each from its own initial noise (the released runs: 4 GPUs x 2 "
                          "videos = 8)", lo=2)
    candidate_fraction: float = opt(0.5, "each prompt's SDE step is drawn uniformly from the first "
                                    "int(T * fraction) steps (the released code: indices 0-9 of 20)", lo=0.0,
                                    lo_open=True, hi=1.0)
    step_weight: str = opt("inverse_scale", "per-edge loss weight: inverse_scale (1 / lambda(sigma_j) over its mean "
                           "across the batch's trained edges: the paper's temporal gradient rectification) or none",
                           choices=["inverse_scale", "none"])


def gradient_scale(sigma: float, sigma_next: float, std: float) -> float:
    """lambda(sigma) = sqrt|dt| / g + g sqrt|dt| (1 - sigma) / (2 sigma) from the edge's std = g sqrt|dt|."""
    dt = abs(sigma_next - sigma)
    return dt / std + std * (1 - sigma) / (2 * sigma)


class FlashGRPO(TransitionAlgorithm):
    Options = FlashGRPOOptions
    advantage_defaults = {"std": "global"}  # the released PerPromptStatTracker(global_std=True)

    @classmethod
    def check(cls, cfg) -> None:
        o, t = cfg.algorithm, cfg.sampler.num_steps
        if int(t * o.candidate_fraction) < 1:
            raise ConfigError(f"algorithm.candidate_fraction: {o.candidate_fraction} of {t} steps leaves no step "
                              "to draw; raise it or sampler.num_steps")
        if o.step_weight == "inverse_scale" and cfg.sampler.kernel not in SAME_DRIFT:
            raise ConfigError(f"algorithm.step_weight=inverse_scale: the gradient scale is that of the Flow-SDE drift "
                              f"(kernels {', '.join(SAME_DRIFT)}), not {cfg.sampler.kernel}'s; change "
                              "sampler.kernel or set algorithm.step_weight=none")

    def candidates(self) -> int:
        return max(1, int(self.cfg.sampler.num_steps * self.opts.candidate_fraction))

    def plan(self, it: int, rng: random.Random | None = None, sigmas: torch.Tensor | None = None) -> RolloutPlan:
        """G independent roots per prompt; ODE everywhere but each prompt's own step j (SDE, trained)."""
        t, o = self.cfg.sampler.num_steps, self.opts
        rng = rng or random.Random(self.cfg.train.seed * 1000003 + it)
        adv = self.cfg.advantage
        drawn = self.cfg.train.prompts_per_iter + (adv.refill_extra if adv.zero_variance == "drop_refill" else 0)
        js = [rng.randrange(self.candidates()) for _ in range(drawn)]
        variants = [[StepSpec(sde=i == j, trained=i == j) for i in range(t)] for j in js]
        return RolloutPlan(variants[0], roots_per_prompt=o.group_size, prompt_steps=variants,
                           notes={"sde_step_mean": sum(js) / len(js)})

    def loss_weights(self, tree, masks) -> dict[int, float] | None:
        """{grid index j: c(sigma_j) / mean of c over the trained edges}, c = 1 / lambda (module text)."""
        if self.opts.step_weight == "none":
            return None
        grid = tree.sigmas.tolist()
        scale: dict[int, float] = {}
        edges = []  # the grid index of every trained edge's parent
        for r in range(1, tree.num_rounds + 1):
            for c in torch.nonzero(masks[r]).flatten().tolist():
                i = int(tree.index[r - 1][tree.parent[r][c]])
                scale.setdefault(i, 1.0 / gradient_scale(grid[i], grid[i + 1], float(tree.std[r][c])))
                edges.append(i)
        if not edges:
            return None
        mean = sum(scale[i] for i in edges) / len(edges)
        return {i: c / mean for i, c in scale.items()}
