"""Algorithm presets: each turns (config, iteration) into a rollout plan and an edge selection.

- ``flow_grpo``: G independent initial noises per prompt, every step SDE, train the first
  int(T * timestep_fraction) steps (Flow-GRPO trains steps 0..8 of 10).
- ``dance_grpo``: like flow_grpo but with ``shared_noise`` the G samples share one initial noise, i.e. one
  root that branches G ways at the first step; trains a random int((T-1) * timestep_fraction) steps per
  sample path (``timestep_selection=random``).
- ``mix_grpo`` / ``flow_grpo_fast``: SDE only inside a window of ``window.size`` steps (fixed, random or
  progressive placement), ODE elsewhere, only window steps trained. With shared noise the ODE prefix is
  computed once per prompt and the group branches at the window's first step.
"""

from __future__ import annotations

import random

import torch

from .samplers import RolloutPlan, StepSpec


def window_start(cfg, iteration: int, rng: random.Random) -> int:
    """Start index of the SDE window at ``iteration``."""
    w = cfg.algorithm.window
    t = cfg.sampler.num_steps
    end = t - 1 if w.range_end < 0 else w.range_end
    last_start = end - w.size
    if w.placement == "fixed":
        return min(w.start, last_start)
    if w.placement == "random":
        return rng.randint(w.range_start, last_start)
    # progressive: move by `stride` every `iters_per_shift` iterations, roll back (or stay) at the end
    positions = max(last_start - w.range_start, 0) // max(w.stride, 1) + 1 if w.stride > 0 else 1
    k = iteration // w.iters_per_shift
    k = k % positions if w.roll_back else min(k, positions - 1)
    return w.range_start + k * w.stride


def build_plan(cfg, iteration: int, rng: random.Random | None = None) -> RolloutPlan:
    a, t = cfg.algorithm, cfg.sampler.num_steps
    rng = rng or random.Random(cfg.train.seed * 1000003 + iteration)
    g = a.group_size
    if a.name in ("flow_grpo", "dance_grpo"):
        sde = [True] * t
        if a.name == "flow_grpo":
            n_train = max(1, min(int(t * a.timestep_fraction), t))
            trained = [i < n_train for i in range(t)]
        else:  # DanceGRPO never trains the last step; the per-path subset is drawn in select_edges
            trained = [i < t - 1 or t == 1 for i in range(t)]
        notes = {}
    else:  # mix_grpo / flow_grpo_fast
        start = window_start(cfg, iteration, rng)
        sde = [start <= i < start + a.window.size for i in range(t)]
        trained = list(sde)
        notes = {"window_start": start}
    steps = [StepSpec(sde=s, trained=tr) for s, tr in zip(sde, trained)]
    if a.shared_noise:
        first_sde = sde.index(True)
        steps[first_sde].branch = g
        roots = 1
    else:
        roots = g
    return RolloutPlan(steps, roots_per_prompt=roots, notes=notes)


def select_edges(cfg, tree, generator: torch.Generator) -> list[torch.Tensor]:
    """Per depth d = 1..T, a bool mask over the nodes at d: train the edge into that node.

    Starts from the plan's ``trained`` flags. With ``timestep_selection=random`` each root-to-leaf path keeps
    a random int(n_candidates * timestep_fraction) of its candidate steps (DanceGRPO); in a flat tree each
    edge lies on exactly one path.
    """
    plan = tree.plan
    masks = [torch.zeros(0, dtype=torch.bool)]
    for d, spec in enumerate(plan.steps, start=1):
        masks.append(torch.full((tree.latents[d].shape[0],), spec.trained, dtype=torch.bool))
    if cfg.algorithm.timestep_selection != "random":
        return masks
    candidates = [d for d, spec in enumerate(plan.steps, start=1) if spec.trained]
    keep = max(1, int(len(candidates) * cfg.algorithm.timestep_fraction))
    n_leaves = tree.latents[-1].shape[0]
    # chosen[leaf] = the depths trained on this leaf's path
    chosen = torch.zeros(n_leaves, plan.num_steps + 1, dtype=torch.bool)
    for leaf in range(n_leaves):
        perm = torch.randperm(len(candidates), generator=generator)[:keep]
        chosen[leaf, [candidates[i] for i in perm.tolist()]] = True
    # walk each leaf's path upwards: an edge is trained if any leaf below it chose its depth
    node = torch.arange(n_leaves)
    for d in range(plan.num_steps, 0, -1):
        sel = torch.zeros(tree.latents[d].shape[0], dtype=torch.bool)
        sel.index_fill_(0, node[chosen[:, d]], True)
        masks[d] &= sel
        node = tree.parent[d][node]
    return masks
