"""The rollout runner: one iteration's prompts -> one tree with every leaf scored, on every process.

It owns what lies between the engine and the trainer: splitting the prompts into ``sampler.rollout_batches``
batches and dealing them to the processes, a generator per batch (so a batch's tree does not depend on which
process rolls it out), packing the batches through shared transformer calls, the reward worker (a thread that
scores batch k while batch k + 1 is rolled out; closed with the runner), gathering every batch's tree and scores
onto every process, and the timing of each phase.
"""

from __future__ import annotations

import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .engine import Tree, packed_rollouts
from .rewards.registry import RewardScores


@dataclass
class RolloutOptions:
    """What the runner passes to the engine, read from the config once (the engine never sees the config)."""

    kernel: str
    noise_level: float
    max_batch: int
    guidance_scale: float
    log_prob_reduce: str
    kernel_options: dict
    store_mean: bool  # keep each edge's sampling mean (an objective that normalises by the old mean asks for it)
    rollout_batches: int
    async_reward: bool
    pack_rollouts: bool
    pack_stagger: int
    noise_on_device: bool
    sharded: bool = False  # train.fsdp: every process makes as many transformer calls as the busiest

    @classmethod
    def from_config(cls, cfg, kernel_options: dict, store_mean: bool) -> "RolloutOptions":
        s = cfg.sampler
        return cls(kernel=s.kernel, noise_level=s.noise_level, max_batch=s.max_batch, guidance_scale=s.guidance_scale,
                   log_prob_reduce=cfg.train.log_prob_reduce, kernel_options=kernel_options, store_mean=store_mean,
                   rollout_batches=s.rollout_batches, async_reward=s.async_reward, pack_rollouts=s.pack_rollouts,
                   pack_stagger=s.pack_stagger, noise_on_device=s.noise_device == "device",
                   sharded=cfg.train.fsdp.enabled)


class RolloutRunner:
    """Rolls out and scores an iteration's prompts (:meth:`__call__`). Use it as a context manager, or call
    :meth:`close`: the reward worker thread ends with it."""

    def __init__(self, adapter, rewards, procs, options: RolloutOptions, sigmas: torch.Tensor,
                 latent_shape: tuple[int, ...], negative=None):
        self.adapter, self.rewards, self.procs, self.options = adapter, rewards, procs, options
        self.sigmas, self.latent_shape, self.negative = sigmas, latent_shape, negative
        self._pool: ThreadPoolExecutor | None = None
        self.ledger = None
        if options.sharded:
            from .sharding import CallLedger

            self.ledger = CallLedger(adapter.transformer, adapter.device)

    def __enter__(self) -> "RolloutRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """End the reward worker (waiting for a scoring in flight); the runner may be used again afterwards."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _worker(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flowrl-reward")
        return self._pool

    def batch_bounds(self, n: int) -> list[int]:
        """The first prompt of each of an iteration's rollout batches, and n: ``n`` prompts in
        min(rollout_batches, n) batches as even as they come."""
        k = min(self.options.rollout_batches, n)
        return [round(i * n / k) for i in range(k + 1)]

    def my_batches(self, n: int) -> list[list[int]]:
        """The prompts of each rollout batch of ``n`` prompts that this process rolls out (its batches, dealt
        round-robin; in one process every batch)."""
        bounds = self.batch_bounds(n)
        return [list(range(bounds[j], bounds[j + 1])) for j in self.procs.share(list(range(len(bounds) - 1)))]

    def __call__(self, cond, plan, gen: torch.Generator, prompts: list[str], metadata: list, roots=None,
                 initial_noise: torch.Tensor | None = None):
        """Roll out ``plan`` for every prompt (rows of ``cond``) and score the leaves; ``initial_noise`` (every
        prompt's roots, *latent) replaces the roots' draw (a candidate pool's choice).

        Returns (tree, scores, timing): seconds_rollout (rollout + decode), seconds_reward (scorer time, summed
        over batches), seconds_reward_wait (time spent waiting for scores after the last rollout) and
        seconds_reward_hidden = seconds_reward - seconds_reward_wait (the time the overlap saved)."""
        o, procs = self.options, self.procs
        n = len(prompts)
        bounds = self.batch_bounds(n)
        k = len(bounds) - 1
        use_async = o.async_reward and k > 1
        pool = self._worker() if use_async else None

        def score(images, rows):
            start = time.perf_counter()
            out = self.rewards(images, [prompts[g] for g in rows], [metadata[g] for g in rows])
            return out, time.perf_counter() - start

        # One batch draws from the iteration's generator; several draw each from its own generator forked from it,
        # so a batch's tree does not depend on which process rolls it out (batches are dealt round-robin).
        gens = [gen] if k == 1 else [torch.Generator().manual_seed(int(s))
                                     for s in torch.randint(1 << 62, (k,), generator=gen)]
        device = self.adapter.device
        if o.noise_on_device and device.type != "cpu":  # noise drawn where it is used
            gens = [torch.Generator(device).manual_seed(int(torch.randint(1 << 62, (1,), generator=g)))
                    for g in gens]
        mine = procs.share(list(range(k)))
        trees, pending = {}, {}

        def done(j, part):  # decode batch j's leaves and score them (in the reward thread with async_reward)
            trees[j] = part
            if procs.context_rank:  # context parallel: the group's first process scores its samples
                pending[j] = (None, 0.0)
                return
            images = self.adapter.decode(part.leaves)
            rows = (part.leaf_group + bounds[j]).tolist()
            pending[j] = pool.submit(score, images, rows) if use_async else score(images, rows)

        # My batches through one driver: packed, each starts `stagger` rounds after the one before and shares its
        # calls; unpacked, each starts when the one before has finished (a stagger no plan reaches).
        stagger = (o.pack_stagger or math.ceil(plan.num_steps / max(len(mine), 1)) if o.pack_rollouts
                   else sys.maxsize)
        start = time.perf_counter()
        if self.ledger is not None:
            self.ledger.arm()
        packed_rollouts(self.adapter, cond, [(bounds[j], bounds[j + 1], gens[j]) for j in mine], plan, self.sigmas,
                        self.latent_shape, stagger=stagger, roots=roots, initial_noise=initial_noise,
                        on_done=lambda i, part: done(mine[i], part),
                        kernel=o.kernel, noise_level=o.noise_level, max_batch=o.max_batch,
                        guidance_scale=o.guidance_scale, negative=self.negative, log_prob_reduce=o.log_prob_reduce,
                        kernel_options=o.kernel_options, store_mean=o.store_mean)
        padding = 0
        if self.ledger is not None:  # sharded: join the others' remaining calls on one row, output dropped
            from .sharding import pad_call

            padding = procs.sum(self.ledger.finish(pad_call(self.adapter, self.latent_shape, cond)))
        t_rollout = time.perf_counter() - start  # with the decodes (and the scoring, taken off below where sync)
        trees = [trees[j] for j in mine]
        pending = [pending[j] for j in mine]
        start = time.perf_counter()
        results = [p.result() if use_async and not isinstance(p, tuple) else p for p in pending]
        wait = time.perf_counter() - start if use_async else sum(r[1] for r in results)
        scored = sum(r[1] for r in results)
        if not use_async:  # the scoring ran inside the rollout loop
            t_rollout -= scored
        if procs.distributed:  # every process gets every batch's tree and scores, in batch order
            parts = procs.gather([(j, t.to("cpu"), r[0]) for j, t, r in zip(mine, trees, results)])
            parts.sort(key=lambda part: part[0])  # (a process may hold no batch when an iteration has few prompts)
            trees = [t.to(device) for _, t, _ in parts]
            results = [(scores, 0.0) for _, _, scores in parts]
        return Tree.concat(trees), RewardScores.concat([r[0] for r in results]), {
            "seconds_rollout": t_rollout, "seconds_reward": scored, "seconds_reward_wait": wait,
            "seconds_reward_hidden": max(0.0, scored - wait), "rollout_batches": k,
            **({"padding_calls_rollout": padding} if self.ledger is not None else {})}
