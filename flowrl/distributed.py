"""Processes of one run (``accelerate launch``): who does which share of the work and how results meet.

The scheme keeps a multi-process run equal to a one-process run on the same seeds (up to float summation order):

- every process draws the same prompts, plan and random numbers (the generators are seeded by seed and
  iteration), so each holds the same decisions without exchanging them;
- the rollout's prompt batches (``sampler.rollout_batches``, each with its own generator) are dealt round-robin
  to the processes; each rolls out and scores its batches, and the trees and scores are gathered in batch order,
  so every process holds the whole tree: one prompt's group may span processes, and group statistics,
  zero-variance counts and curricula see all of it;
- each minibatch's work items are dealt round-robin; gradients are summed over processes once per optimizer step
  (each process's loss is already divided by the whole minibatch's rows), so the step equals one process's;
- held-out evaluations and sample grids: each process samples a contiguous share of the prompts and every
  process reads every image (:class:`ShardedSampler`); the main process's numbers are broadcast, so early
  stopping is decided alike everywhere;
- only the main process writes metrics, grids, checkpoints and tracker logs.
"""

from __future__ import annotations

import torch

from .errors import ConfigError


class Processes:
    """The run's process group as seen from one process (a single process is a group of one).

    With context parallelism (``train.context_parallel``, degree c) the processes form groups of c consecutive
    ranks that split each sample's sequence and do the same work: ``world`` and ``rank`` count those groups (the
    data-parallel shares), ``processes`` and ``global_rank`` the processes. Gathers keep the first process of each
    group, so every sample appears once."""

    def __init__(self, device: torch.device, context: int = 1):
        from accelerate import PartialState

        self.state = PartialState(cpu=device.type == "cpu")
        self.processes = self.state.num_processes
        self.global_rank = self.state.process_index
        self.is_main = self.state.is_main_process
        self.context = context
        self.world = self.processes // context
        self.rank = self.global_rank // context
        self.context_rank = self.global_rank % context

    @property
    def distributed(self) -> bool:
        return self.processes > 1

    def check_rollout_batches(self, rollout_batches: int) -> None:
        """Each data-parallel share rolls out whole prompt batches: one line when there are fewer than shares."""
        if self.world > rollout_batches:
            raise ConfigError(f"sampler.rollout_batches={rollout_batches}: {self.world} processes each roll out "
                              f"whole prompt batches; set sampler.rollout_batches to at least {self.world} (a "
                              "multiple of it keeps the processes evenly loaded)")

    def share(self, items: list) -> list:
        """This process's share of ``items`` (round-robin, so shares differ in length by at most one)."""
        return items[self.rank:: self.world]

    def gather(self, objects: list) -> list:
        """Every process's ``objects`` concatenated in rank order, on every process (picklable CPU objects)."""
        if not self.distributed:
            return list(objects)
        parts = [None] * self.processes
        torch.distributed.all_gather_object(parts, list(objects))
        return [obj for r, part in enumerate(parts) if r % self.context == 0 for obj in part]

    def broadcast(self, obj):
        """The main process's ``obj`` on every process."""
        if not self.distributed:
            return obj
        from accelerate.utils import broadcast_object_list

        return broadcast_object_list([obj])[0]

    def gather_rows(self, *columns: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Per-row statistics of an update from every process: each column (a list of tensors) becomes every
        process's rows, one CPU tensor per process that has any."""
        if not self.distributed:
            return [list(c) for c in columns]
        return [[torch.cat(part) for part in self.gather([[t.cpu() for t in c]]) if part] for c in columns]

    def sum(self, value: float) -> float:
        """``value`` summed over processes."""
        return sum(self.gather([value])) if self.distributed else value

    def any(self, flag: bool) -> bool:
        """True on every process when ``flag`` is true on any (e.g. a SIGTERM that reached one process)."""
        return any(self.gather([bool(flag)])) if self.distributed else bool(flag)

    def barrier(self) -> None:
        if self.distributed:
            self.state.wait_for_everyone()

    def sum_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Sum each parameter's gradient over processes (one flattened all-reduce); a process that trained no
        item this step contributes zeros."""
        if not self.distributed:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        for p, g in zip(params, _flat_collective(grads, torch.distributed.all_reduce)):
            p.grad = g.to(p.dtype)



class ShardedSampler:
    """A sampler (``sampler(prompts, seeds)`` -> prompt-major images) whose prompts are split into contiguous
    shares, one per process; every process gets every image, in order. Every process must call it alike (the
    held-out evaluations and sample grids run on all of them); one image depends only on its prompt and seed."""

    @classmethod
    def shared(cls, sampler, procs: Processes, equal_shares: bool = False):
        """``sampler`` itself in one process; with several, a ShardedSampler over them."""
        return cls(sampler, procs, equal_shares) if procs.distributed else sampler

    def __init__(self, sampler, procs: Processes, equal_shares: bool = False):
        self.sampler, self.procs, self.equal_shares = sampler, procs, equal_shares

    def __call__(self, prompts: list[str], seeds: list[int]) -> torch.Tensor:
        n, world, rank = len(prompts), self.procs.world, self.procs.rank
        bounds = [round(i * n / world) for i in range(world + 1)]
        mine = prompts[bounds[rank]: bounds[rank + 1]]
        pad = 0
        if self.equal_shares:  # sharded: every process samples as many prompts (padding repeats one, dropped)
            pad = max(b - a for a, b in zip(bounds, bounds[1:])) - len(mine)
            mine = mine + [mine[-1] if mine else prompts[0]] * pad
        images = self.sampler(mine, seeds).cpu() if mine else None  # (len(mine) * S, ...) prompt-major
        if images is not None and pad:
            images = images[: len(images) - pad * len(seeds)] if len(mine) > pad else None
        return torch.cat([part for part in self.procs.gather([images]) if part is not None])


def check_launch(accelerator) -> None:
    """Multi-process training sums gradients itself (data parallel); sharded launches are refused up front."""
    from accelerate.utils import DistributedType

    from .errors import ConfigError

    kind = accelerator.distributed_type
    if kind not in (DistributedType.MULTI_GPU, DistributedType.MULTI_CPU, DistributedType.MULTI_XPU,
                    DistributedType.MULTI_NPU, DistributedType.MULTI_MLU, DistributedType.MULTI_MUSA):
        raise ConfigError(f"accelerate launch: flowrl trains data-parallel (every process holds the whole model); "
                          f"{kind.value} is not supported yet; launch with configs/accelerate/multi_gpu.yaml")


def _flat_collective(tensors: list[torch.Tensor], collective) -> list[torch.Tensor]:
    """``collective`` (in place) on all ``tensors`` as one flattened buffer; returns views of the result shaped
    like the inputs."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    collective(flat)
    return [part.view_as(t) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


@torch.no_grad()
def sync_parameters(params: list[torch.nn.Parameter]) -> None:
    """The main process's values of ``params`` on every process (one flattened broadcast)."""
    for p, value in zip(params, _flat_collective(params, lambda flat: torch.distributed.broadcast(flat, src=0))):
        p.copy_(value)
