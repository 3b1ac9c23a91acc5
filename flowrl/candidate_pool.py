"""A cheap candidate pool ahead of the rollout (Sol-RL's "explore cheaply, train exactly", arXiv 2604.06916), as a
sampler choice any method with independent initial noises can use (``sampler.pool``).

Per prompt, ``size`` initial noises are drawn and each is taken to an image by a cheap ODE rollout: fewer steps
(``num_steps``), lower precision (``precision``: bf16 autocast, or int8 / fp8 linear layers quantized from the
current weights, :mod:`flowrl.low_precision`) and its own CFG scale; the images are scored with the run's
rewards. The real rollout then starts from the chosen noises only (``select``: the best half and the worst half of
the cheap rewards, Sol-RL's, or the best, or a random choice as a control), with the plan's steps, kernel,
precision and step noise, so its log-probs are exactly those of a plain rollout from those noises and the first
update's ratio stays 1. The cheap images, rewards and log-probs are never trained on.

Logged per iteration: ``pool/seconds`` (the cheap rollout and its scoring) and its share of the rollout's time,
``pool/nfe`` (its transformer evaluations count in the rollout's), and ``pool/rank_correlation``: the Spearman
correlation, within each prompt, between a chosen candidate's cheap reward and its real reward (the mean over the
prompt's groups). Where the real rollout's first step is stochastic, the real reward depends on that step's noise
as well as the initial noise, and the correlation says how much of it the pool could see.
"""

from __future__ import annotations

import contextlib
import time

import torch

from .engine import rollout
from .errors import ConfigError
from .low_precision import LOW_PRECISIONS, low_precision_linears, unavailable
from .report.correlation import spearman
from .samplers import RolloutPlan, StepSpec


def choose(rewards: torch.Tensor, keep: int, how: str, gen: torch.Generator) -> list[int]:
    """Indices of ``keep`` of one prompt's (N,) cheap rewards: best_worst = the ceil(keep / 2) highest and the
    floor(keep / 2) lowest, best = the ``keep`` highest, random = a uniform choice; NaN ranks lowest. In ascending
    index order, so the real rollout keeps the candidates' order."""
    n = rewards.numel()
    if keep > n:
        raise ValueError(f"cannot keep {keep} of {n} candidates")
    if how == "random":
        return sorted(torch.randperm(n, generator=gen)[:keep].tolist())
    r = torch.nan_to_num(rewards.double(), nan=float("-inf"))
    order = sorted(range(n), key=lambda k: (-float(r[k]), k))  # best first; ties by index
    if how == "best":
        return sorted(order[:keep])
    top, bottom = (keep + 1) // 2, keep // 2
    return sorted(order[:top] + (order[n - bottom:] if bottom else []))


def check_pool(cfg, plan: RolloutPlan, roots: list[int] | None, distributed: bool) -> None:
    """One line where the pool cannot serve this run's plan (known at the first plan, before any rollout)."""
    size = cfg.sampler.pool.size
    if not size:
        return
    if distributed and (cfg.train.fsdp.enabled or cfg.train.context_parallel.degree > 1):
        raise ConfigError("sampler.pool: the cheap pass runs each process's own prompts on its whole transformer "
                          "(data parallel); with train.fsdp or context parallelism set sampler.pool.size=0")
    most = max(roots) if roots else plan.roots_per_prompt
    if most < 2:
        raise ConfigError(f"sampler.pool.size={size}: {cfg.algorithm.name}'s plan starts each prompt from one shared "
                          "noise, so there is nothing to choose among; set sampler.pool.size=0 or a plan with "
                          "independent noises (algorithm.shared_noise=false)")
    if size < most:
        raise ConfigError(f"sampler.pool.size={size}: the plan starts each prompt from {most} noises; the pool needs "
                          f"at least as many candidates")


class CandidatePool:
    """The cheap pass of ``sampler.pool`` for one run (see the module text)."""

    def __init__(self, cfg, adapter, sigmas: torch.Tensor, latent_shape: tuple[int, ...], rewards, negative,
                 procs=None):
        """``sigmas``: the cheap rollout's (pool.num_steps + 1,) grid; ``procs``: the run's processes (data parallel:
        each scores the candidates of the prompts it rolls out, and every process learns every choice)."""
        p, s = cfg.sampler.pool, cfg.sampler
        self.options, self.adapter, self.rewards, self.negative, self.procs = p, adapter, rewards, negative, procs
        self.latent_shape = latent_shape
        self.sigmas = sigmas
        self.guidance = s.guidance_scale if p.guidance_scale is None else p.guidance_scale
        self.max_batch = s.max_batch
        why = unavailable(p.precision, adapter.device)
        if why:
            raise ConfigError(f"sampler.pool.precision={p.precision}: {why}")
        self.cheap_rewards: torch.Tensor | None = None  # (P, N) the last pass's
        self.chosen_rewards: torch.Tensor | None = None  # (sum(roots),) the chosen candidates' cheap rewards

    def precision(self):
        """The cheap pass's arithmetic. fp8 runs the layers that are not linear in bf16 as well; int8's CPU kernels
        take float32 activations, so the rest stays in the model's dtype."""
        p, device = self.options.precision, self.adapter.device.type
        if p == "fp32":
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        if p != "int8":
            stack.enter_context(torch.autocast(device, dtype=torch.bfloat16))
        if p in LOW_PRECISIONS:
            stack.enter_context(low_precision_linears([self.adapter.transformer, *self.adapter.extra_transformers()],
                                                      p))
        return stack

    @torch.no_grad()
    def __call__(self, cond, gen: torch.Generator, prompts: list[str], metadata: list,
                 roots: list[int], batches: list[list[int]] | None = None) -> tuple[torch.Tensor, dict]:
        """The chosen initial noises, (sum(roots), *latent) prompt-major, and the pass's statistics.

        Args:
            cond: the P prompts' encoded batch.
            gen: the iteration's generator: the pool takes one seed from it and draws from its own.
            roots: the real rollout's initial noises per prompt (the plan's roots, or the algorithm's group sizes).
            batches: the prompts of each rollout batch this process rolls out (None: all prompts in one batch). The
                cheap pass runs batch by batch, as the real rollout does (its memory, and the same arithmetic
                however the batches are dealt). Every process draws every candidate's noise from the same seed and
                scores its own batches' candidates; the choices are exchanged, so each process holds every
                prompt's chosen noises and cheap rewards, as one process would.
        """
        o, n, sigmas, start = self.options, self.options.size, self.sigmas, time.perf_counter()
        own = torch.Generator().manual_seed(int(torch.randint(1 << 62, (1,), generator=gen)))
        count = len(prompts)
        noise = torch.randn((count * n, *self.latent_shape), generator=own)  # (P * N, *latent)
        # one seed per prompt for a random choice, so a prompt's choice does not depend on which process makes it
        choice_seeds = torch.randint(1 << 62, (count,), generator=own).tolist()
        plan = RolloutPlan([StepSpec(sde=False) for _ in range(len(sigmas) - 1)], roots_per_prompt=n)
        nfe, cheap_rows = 0, []
        for mine in ([list(range(count))] if batches is None else batches):
            index = torch.tensor(mine)
            with self.precision():
                tree = rollout(self.adapter, cond.index(index.to(self.adapter.device)), plan, sigmas,
                               self.latent_shape, kernel="ode", noise_level=0.0, generator=torch.Generator(),
                               initial_noise=noise.view(count, n, *self.latent_shape)[index].flatten(0, 1),
                               max_batch=self.max_batch, guidance_scale=self.guidance, negative=self.negative)
            images = self.adapter.decode(tree.leaves.float())
            cheap = self.rewards(images, [prompts[g] for g in mine for _ in range(n)],
                                 [metadata[g] for g in mine for _ in range(n)]).total.view(len(mine), n)  # (mine, N)
            nfe += tree.nfe
            cheap_rows += [(g, cheap[i].cpu()) for i, g in enumerate(mine)]
        if self.procs is not None and self.procs.distributed:
            cheap_rows = self.procs.gather(cheap_rows)
            nfe = sum(self.procs.gather([nfe]))
        cheap = torch.stack([r for _, r in sorted(cheap_rows, key=lambda row: row[0])])  # (P, N)
        self.cheap_rewards = cheap
        picks = [choose(cheap[g], roots[g], o.select, torch.Generator().manual_seed(choice_seeds[g]))
                 for g in range(count)]
        self.chosen_rewards = torch.cat([cheap[g, k] for g, k in enumerate(picks)])  # (sum(roots),)
        chosen = torch.cat([noise[g * n + torch.tensor(k)] for g, k in enumerate(picks)])
        return chosen, {"pool/seconds": time.perf_counter() - start, "pool/nfe": nfe,
                        "pool/cheap_reward_mean": float(torch.nan_to_num(cheap).mean()),
                        "pool/chosen_cheap_reward_mean": float(torch.nan_to_num(self.chosen_rewards).mean())}

    def agreement(self, tree, rewards: torch.Tensor) -> dict:
        """``pool/rank_correlation``: per prompt, Spearman between the chosen candidates' cheap rewards and the mean
        real reward of the leaves each grew into, averaged over the prompts where both vary."""
        if self.chosen_rewards is None:
            return {}
        leaf_root = tree.leaf_root
        roots = int(tree.rounds[0].size)
        real = torch.stack([rewards[leaf_root == r].double().nanmean() for r in range(roots)])  # (R,)
        group = tree.rounds[0].group
        values = [spearman(self.chosen_rewards[group == g], real[group == g]) for g in group.unique().tolist()]
        values = [v for v in values if v == v]
        return {"pool/rank_correlation": sum(values) / len(values)} if values else {}
