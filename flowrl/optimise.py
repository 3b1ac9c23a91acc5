"""The one optimisation loop every objective runs through: inner epochs, minibatches, micro-batches with gradient
accumulation, the gradient sum over processes, clipping, the optimizer step, the EMA, and the non-finite check.

The objective (flowrl/objectives.py) says what a work item is and what it costs; this loop says how many go into
an optimizer step and in which order. All draws come from the iteration's generator, on every process alike.
"""

from __future__ import annotations

import math

import torch

from .errors import ConfigError, FlowRLError
from .objectives import Objective, UpdateBatch


def learning_rate(train_cfg, iteration: int) -> float:
    """``train.lr`` shaped by ``train.lr_schedule`` at ``iteration``: a linear warmup over the first
    ``train.warmup_iterations`` ((k + 1) / warmup of the peak at iteration k), then constant, or a linear or cosine
    decay that reaches 0 at ``train.iterations``. It depends on the iteration alone: a resumed run follows the
    uninterrupted run's schedule exactly (raising ``train.iterations`` on resume stretches the decay)."""
    peak, warmup = train_cfg.lr, train_cfg.warmup_iterations
    if iteration < warmup:
        return peak * (iteration + 1) / warmup
    if train_cfg.lr_schedule == "constant":
        return peak
    progress = min(1.0, (iteration - warmup) / max(1, train_cfg.iterations - warmup))
    if train_cfg.lr_schedule == "linear":
        return peak * (1.0 - progress)
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))


def micro_batches(numbered: list, max_size: int, size):
    """Consecutive groups of (index, item) pairs whose items hold at most ``max_size`` transformer inputs by
    ``size(item)`` (at least one item per group)."""
    group, total = [], 0
    for pair in numbered:
        n = size(pair[1])
        if group and total + n > max_size:
            yield group
            group, total = [], 0
        group.append(pair)
        total += n
    if group:
        yield group


def check_update_composition(objective, cfg) -> None:
    """``train.update_composition=rollout`` needs an objective that keys its items by rollout call: one line
    otherwise."""
    if cfg.train.update_composition == "rollout" and not objective.keys_rollout_calls:
        raise ConfigError(f"train.update_composition=rollout: {cfg.algorithm.name} does not recompute the "
                          "rollout's transitions; set train.update_composition=micro_batch")


def _groups(objective, numbered: list, max_size: int) -> list[list]:
    """The micro-batches: by size, or, where the objective keys its items (one rollout call per micro-batch under
    ``train.update_composition=rollout``), the items of one key together, keys in order of first appearance."""
    keys = [objective.group_key(item) for _, item in numbered]
    if not keys or keys[0] is None:
        return list(micro_batches(numbered, max_size, objective.item_size))
    by_key: dict = {}
    for pair, k in zip(numbered, keys):
        by_key.setdefault(k, []).append(pair)
    return list(by_key.values())


def optimise(objective: Objective, batch: UpdateBatch, policy, procs, train_cfg, gen: torch.Generator,
             iteration: int = 0) -> dict:
    """Train ``policy`` on one iteration's ``batch`` with ``objective``: epochs, minibatches, micro-batches,
    gradient accumulation, the gradient sum over processes, clipping, the optimizer step and the EMA.

    Args:
        objective: the algorithm's :class:`~flowrl.objectives.Objective`.
        batch: the rollout's tree, advantages and trained-edge masks.
        policy: the trained weights with their optimizer (:class:`flowrl.policy.Policy`).
        procs: the processes (world size, rank, collectives).
        train_cfg: the config's ``train`` section.
        gen: the iteration's generator.
        iteration: the iteration (the learning rate's schedule reads it).
    Returns:
        The update's statistics: the objective's, plus ``optimizer_steps`` and the mean pre-clip gradient norm.

    Sharded (``train.fsdp``), a process whose share of a minibatch makes fewer micro-batches than another's adds
    zero-weight ones (the loss of the minibatch's first item times 0, not recorded in the statistics): its
    forwards and backwards are collectives that every process must join."""
    accelerator, opt = policy.accelerator, policy.optimizer
    policy.adapter.transformer.train()
    lr = learning_rate(train_cfg, iteration)
    for group in opt.param_groups:  # this iteration's learning rate (train.lr_schedule)
        group["lr"] = lr
    items = objective.work_items(batch, gen)
    steps, grad_norms, padded = 0, [], 0
    for _ in range(train_cfg.inner_epochs if items else 0):
        order = torch.randperm(len(items), generator=gen).tolist()
        n_mb = min(train_cfg.num_minibatches, len(order))
        for mb in range(n_mb):
            mb_items = [items[i] for i in order[mb::n_mb]]
            n_rows = sum(objective.item_rows(it) for it in mb_items)  # the whole minibatch's, on every process
            objective.begin_minibatch(mb_items, gen)
            opt.zero_grad(set_to_none=True)
            numbered = list(enumerate(mb_items))
            groups = _groups(objective, procs.share(numbered), train_cfg.micro_batch)
            for group in groups:
                accelerator.backward(objective.micro_batch_loss(group) / n_rows)
            if policy.sharded:  # every process runs as many forwards and backwards as the busiest (zero weight)
                most = max(len(list(micro_batches(numbered[r::procs.world], train_cfg.micro_batch,
                                                  objective.item_size))) for r in range(procs.world))
                for _ in range(most - len(groups)):
                    accelerator.backward(objective.micro_batch_loss(numbered[:1], record=False) * 0.0)
                    padded += 1
            extra = objective.end_minibatch(gen)
            if extra is not None:
                accelerator.backward(extra)
            if not policy.sharded:  # FSDP has reduced them in the backward
                procs.sum_gradients(policy.params)
            grad_norms.append(policy.clip_gradients(train_cfg.max_grad_norm))
            if not math.isfinite(grad_norms[-1]):  # before the step: the weights stay finite
                raise FlowRLError("non-finite gradient norm; lower train.lr or use fp32 (train.mixed_precision=no)")
            opt.step()
            steps += 1
            objective.after_optimizer_step()
            if policy.ema is not None and steps % train_cfg.ema.update_every == 0:
                policy.ema.step(policy.params)
    stats = objective.statistics()
    if policy.sharded:
        stats["padding_micro_batches"] = procs.sum(padded)
    stats.update({"optimizer_steps": steps, "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else 0.0,
                  "lr": lr})
    return stats
