"""Algorithm presets: each turns (config, iteration) into a rollout plan, edge advantages and an edge selection.

- ``flow_grpo``: G independent initial noises per prompt, every step SDE, train the first
  int(T * timestep_fraction) steps (Flow-GRPO trains steps 0..8 of 10).
- ``dance_grpo``: like flow_grpo but with ``shared_noise`` the G samples share one initial noise, i.e. one
  root that branches G ways at the first step; trains a random int((T-1) * timestep_fraction) steps per
  sample path (``timestep_selection=random``).
- ``mix_grpo`` / ``flow_grpo_fast``: SDE only inside a window of ``window.size`` steps (fixed, random or
  progressive placement), ODE elsewhere, only window steps trained. ``flow_grpo``, ``dance_grpo``,
  ``chunk_grpo`` and ``superflow`` take the same window when ``window.size > 0`` (their own step rules,
  timestep subsets and chunks, then apply inside it). With shared noise the ODE prefix is
  computed once per prompt and the group branches at the window's first step.
- ``branch_grpo``: one root per prompt, branch K at the split steps (K ** |B| leaves), every edge trained;
  reward fusion up the tree, depth-wise z-score, width / depth pruning; ``tree.mix`` = ODE outside the
  split steps and the SDE window.
- ``tempflow_grpo``: per seed an ODE main line; at every active step K one-step SDE branches completed by
  ODE; one advantage group per (prompt or seed, step); noise-aware loss weight.
- ``e_grpo``: an ODE anchor; at each active step K merged SDE jumps of length l_i (entropy rule) completed
  by ODE; one advantage group per (prompt, step).

Leaf advantages become edge advantages by averaging the advantages of the leaves below each edge: in flat
trees and side branches every trained edge has exactly one leaf below it.
"""

from __future__ import annotations

import math
import random

import torch

from .advantages import group_advantages
from .config import WINDOWABLE
from .errors import ConfigError
from .samplers import RolloutPlan, StepSpec
from .samplers.kernels import flow_grpo_noise_scale
from . import trees

SIDE_BRANCH = ("tempflow_grpo", "e_grpo", "ada_grpo")


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


def step_entropy_score(sigmas: torch.Tensor, i: int, length: int, noise_level: float, scale: str) -> float:
    """E-GRPO's entropy of the SDE step sigma_i -> sigma_{i+length} on the scale tau is compared with.

    The transition is N(mu, s^2 I) with s^2 = g(sigma_i)^2 (sigma_i - sigma_{i+l}), g the kernel's
    a sqrt(sigma / (1 - sigma_r)) (sigma_r = sigma_1 in the denominator at sigma = 1, as in the kernel). Per dimension h/d = 0.5 log(2 pi e s^2), so
    exp_entropy_per_dim = sqrt(2 pi e s^2), variance = 2 pi e s^2, log_variance = log(2 pi e s^2).
    """
    s = float(sigmas[i])
    var = flow_grpo_noise_scale(s, float(sigmas[1]), noise_level) ** 2 * (s - float(sigmas[i + length]))
    v = 2 * math.pi * math.e * var
    return {"exp_entropy_per_dim": math.sqrt(v), "variance": v, "log_variance": math.log(v)}[scale]


def entropy_merge_lengths(sigmas: torch.Tensor, steps: list[int], noise_level: float, tau: float, scale: str) -> list[int]:
    """Smallest l per active step whose merged step's entropy score reaches tau (l = 1 for high-entropy steps;
    the longest possible merge when none does)."""
    t = len(sigmas) - 1
    out = []
    for i in steps:
        lengths = range(1, t - i + 1)
        out.append(next((l for l in lengths if step_entropy_score(sigmas, i, l, noise_level, scale) >= tau), t - i))
    return out


def _check_steps(name: str, steps: list[int], t: int) -> list[int]:
    bad = [s for s in steps if not 0 <= s < t]
    if bad:
        raise ConfigError(f"{name}: steps {bad} are outside 0..{t - 1} for sampler.num_steps={t}")
    if len(set(steps)) != len(steps):
        raise ConfigError(f"{name}: steps {steps} repeat a step")
    return sorted(steps)


def active_side_steps(cfg) -> list[int]:
    a, t = cfg.algorithm, cfg.sampler.num_steps
    if a.side.steps:
        return _check_steps("algorithm.side.steps", a.side.steps, t)
    if a.name == "tempflow_grpo":
        return list(range(max(t - 1, 1)))
    if a.name == "ada_grpo":  # every other step of the first half: {0, 2, 4, 6} of 16
        return list(range(0, max(t // 2, 1), 2))
    return list(range(max(t // 2, 1)))


def build_plan(cfg, iteration: int, rng: random.Random | None = None, sigmas: torch.Tensor | None = None) -> RolloutPlan:
    a, t = cfg.algorithm, cfg.sampler.num_steps
    rng = rng or random.Random(cfg.train.seed * 1000003 + iteration)
    g = a.group_size
    if a.name == "branch_grpo":
        return _branch_plan(cfg, iteration, rng)
    if a.name in SIDE_BRANCH:
        return _side_plan(cfg, sigmas)
    if a.name in WINDOWABLE and a.window.size == 0:
        sde = [True] * t
        if a.name in ("flow_grpo", "superflow"):
            n_train = max(1, min(int(t * a.timestep_fraction), t))
            trained = [i < n_train for i in range(t)]
        else:  # DanceGRPO and Chunk-GRPO never train the last step (subsets: select_edges / chunks)
            trained = [i < t - 1 or t == 1 for i in range(t)]
        notes = {}
    else:  # mix_grpo / flow_grpo_fast, or a flat preset restricted to a window (hybrid ODE-SDE sampling)
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


def _branch_plan(cfg, iteration: int, rng: random.Random) -> RolloutPlan:
    a, t, tc = cfg.algorithm, cfg.sampler.num_steps, cfg.algorithm.tree
    splits = _check_steps("algorithm.tree.split_steps", tc.split_steps, t)
    leaves = tc.branch_factor ** len(splits)
    if leaves != a.group_size:
        raise ConfigError(f"algorithm.group_size ({a.group_size}) must equal tree.branch_factor ** len(tree.split_steps) "
                          f"= {tc.branch_factor}^{len(splits)} = {leaves} for branch_grpo; set algorithm.group_size={leaves}")
    notes = {}
    if tc.mix:
        start = window_start(cfg, iteration, rng) if a.window.size else 0
        sde = [i in splits or start <= i < start + a.window.size for i in range(t)]
        notes["window_start"] = start
    else:
        sde = [True] * t
    steps = [StepSpec(sde=sde[i], branch=tc.branch_factor if i in splits else 1, trained=sde[i],
                      sibling_noise=tc.sibling_noise, sibling_strength=tc.sibling_strength) for i in range(t)]
    return RolloutPlan(steps, roots_per_prompt=1, notes=notes)


def _side_plan(cfg, sigmas: torch.Tensor | None) -> RolloutPlan:
    a, t, sc = cfg.algorithm, cfg.sampler.num_steps, cfg.algorithm.side
    active = active_side_steps(cfg)
    if a.name == "e_grpo" and sc.merge == "adaptive":
        if sigmas is None:
            raise ValueError("e_grpo's adaptive merge needs the sigma grid")
        merges = entropy_merge_lengths(sigmas, active, cfg.sampler.noise_level, sc.tau, sc.tau_scale)
    elif a.name == "e_grpo":
        if len(sc.merge_lengths) != len(active):
            raise ConfigError(f"algorithm.side.merge_lengths needs one length per active step ({len(active)}), "
                              f"got {len(sc.merge_lengths)}")
        merges = list(sc.merge_lengths)
    else:
        merges = [1] * len(active)
    for i, l in zip(active, merges):
        if not 1 <= l <= t - i:
            raise ConfigError(f"algorithm.side.merge_lengths: step {i} cannot merge {l} steps (at most {t - i})")
    last = active[-1]
    steps = []
    for i in range(t):
        k = active.index(i) if i in active else -1
        steps.append(StepSpec(sde=False, branch=0 if i == last else 1, trained=False,
                              side=a.group_size if k >= 0 else 0, side_merge=merges[k] if k >= 0 else 1,
                              side_granularities=tuple(sc.granularities)))
    return RolloutPlan(steps, roots_per_prompt=sc.seeds, notes={"active_steps": active, "merge_lengths": merges})


# ------------------------------------------------------------------------------------------------ advantages
def leaf_group_ids(cfg, tree) -> torch.Tensor:
    """Advantage group of every leaf: the prompt, or for side-branch presets (prompt or seed, active step)."""
    if cfg.algorithm.name not in SIDE_BRANCH:
        return tree.leaf_group
    owner = tree.leaf_group if cfg.algorithm.side.group_by == "prompt" else tree.leaf_root
    key = (owner * (tree.num_steps + 1) + tree.leaf_lineage + 1) * (tree.num_steps + 1) + tree.leaf_stride
    return torch.unique(key, return_inverse=True)[1]


def edge_advantages(cfg, tree, rewards: torch.Tensor, iteration: int, baselines: torch.Tensor | None = None,
                    capability: tuple[float, float] | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor], dict]:
    """Leaf rewards (L,) -> (per-round edge advantages, per-round keep masks from pruning, statistics).

    ``baselines`` (L,): the per-prompt tracker value of each leaf in reward units (superflow, and the
    ``tracker`` zero-variance policy); ``capability``: AdaGRPO's EMA (mean, std) of anchor scores."""
    from .trackers import adagrpo_advantages, superflow_advantages

    a = cfg.algorithm
    if a.name != "branch_grpo":
        groups = leaf_group_ids(cfg, tree)
        adv_leaf, stats = group_advantages(rewards, groups, cfg.advantage, baselines)
        if a.name == "superflow":
            adv_leaf = superflow_advantages(rewards, baselines, cfg.advantage.eps).clamp(-cfg.advantage.clip, cfg.advantage.clip)
        elif a.name == "ada_grpo":
            adv_leaf = adagrpo_advantages(torch.where(torch.isfinite(rewards), rewards, torch.nan), groups,
                                          capability[0], capability[1], cfg.advantage.clip, cfg.advantage.eps)
            adv_leaf = torch.nan_to_num(adv_leaf, nan=0.0)
        keep = [torch.ones(x.shape[0], dtype=torch.bool) for x in tree.latents]
        adv = tree.node_values_from_leaves(adv_leaf)
        if a.name in SIDE_BRANCH and len(a.side.granularities) > 1:  # G2RPO sums the per-granularity advantages
            adv = [x * len(a.side.granularities) for x in adv]
        return adv, keep, stats
    tc = a.tree
    _, stats = group_advantages(rewards, tree.leaf_group, cfg.advantage)  # leaf-level statistics, for logging
    values = trees.fuse_rewards(tree, rewards, tc.fusion, tc.fusion_beta)
    adv, depth_stats = trees.depth_advantages(tree, values, cfg.advantage.ddof, cfg.advantage.eps,
                                              cfg.advantage.zero_std_threshold)
    adv = [x.clamp(-cfg.advantage.clip, cfg.advantage.clip) for x in adv]
    stats.update(depth_stats)
    keep = [torch.ones(x.shape[0], dtype=torch.bool) for x in tree.latents]
    if iteration < tc.prune_until * cfg.train.iterations:
        last_split = max(tc.split_steps)
        keep = trees.width_prune_masks(tree, last_split, tc.width_pruning, values, adv, rewards, tc.width_ratio,
                                       tc.extreme_b)
        stop = last_split + 1 if tc.depth_stop < 0 else tc.depth_stop
        window = trees.depth_window(tc.depth_pruning, iteration, tc.depth_slide_every, stop)
        keep = [k & d for k, d in zip(keep, trees.depth_prune_masks(tree, window))]
        if window:
            stats["depth_window_min"] = min(window)
    return adv, keep, stats


def select_edges(cfg, tree, generator: torch.Generator) -> list[torch.Tensor]:
    """Per round r = 0..R, a bool mask over the nodes of round r: train the edge into that node.

    Starts from the plan's training candidates. With ``timestep_selection=random`` each root-to-leaf path keeps
    a random int(n_candidates * timestep_fraction) of its candidate rounds (DanceGRPO); in a flat tree each
    edge lies on exactly one path.
    """
    masks = [m.clone() for m in tree.trained]
    if cfg.algorithm.timestep_selection != "random" or cfg.algorithm.name in SIDE_BRANCH + ("branch_grpo", "chunk_grpo"):
        return masks
    candidates = [r for r in range(1, tree.num_rounds + 1) if bool(tree.trained[r].any())]
    keep = max(1, int(len(candidates) * cfg.algorithm.timestep_fraction))
    leaf_round, leaf_pos = tree.leaf_positions()
    n_leaves = leaf_pos.numel()
    chosen = torch.zeros(n_leaves, tree.num_rounds + 1, dtype=torch.bool)  # the rounds trained on each leaf's path
    for leaf in range(n_leaves):
        perm = torch.randperm(len(candidates), generator=generator)[:keep]
        chosen[leaf, [candidates[i] for i in perm.tolist()]] = True
    # walk each leaf's path upwards: an edge is trained if any leaf below it chose its round
    node = torch.full((n_leaves,), -1)
    for r in range(tree.num_rounds, 0, -1):
        node = torch.where(leaf_round == r, leaf_pos, node)
        on = node >= 0
        sel = torch.zeros(tree.latents[r].shape[0], dtype=torch.bool)
        sel.index_fill_(0, node[on & chosen[:, r]], True)
        masks[r] &= sel
        node = torch.where(on, tree.parent[r][node.clamp_min(0)], node)
    return masks
