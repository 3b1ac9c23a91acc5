"""What every algorithm module shares: option pieces, the unit of gradient work, and the context an
algorithm may use to choose prompts.

The hooks themselves, with Flow-GRPO's behaviour as the defaults, are :class:`flowrl.algorithms.FlowGRPO`;
every other module subclasses it and overrides only what makes it different.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

import torch
from pydantic import Field

from ..config import AlgorithmOptions, Section, opt
from ..errors import ConfigError


class WindowOptions(Section):
    size: int = opt(0, "SDE window length in steps (0 = no window: the algorithm's own step rule); only the "
                       "window's steps are SDE and trained, ODE elsewhere", lo=0)
    placement: str = opt("fixed", "fixed (at start), random (drawn each iteration) or progressive (moves by stride)",
                         choices=["fixed", "random", "progressive"])
    start: int = opt(0, "first window step for fixed placement", lo=0)
    range_start: int = opt(0, "earliest window start (random / progressive)", lo=0)
    range_end: int = opt(-1, "the window stays before this step (negative counts from the end: -1 = num_steps - 1, "
                            "-2 = num_steps - 2)")
    stride: int = opt(1, "progressive: steps the window moves each shift", lo=0)
    iters_per_shift: int = opt(25, "progressive: iterations before the window moves", lo=1)
    roll_back: bool = opt(True, "progressive: restart at range_start after the last position")
    near_end: str = opt("full", "progressive: full = the window keeps its size and its last start is the last "
                        "where it fits; shrink (MixGRPO's code) = starts run on to range_end, the window is cut "
                        "there, and at range_end it is empty (an iteration that trains nothing)",
                        choices=["full", "shrink"])


class GroupOptions(AlgorithmOptions):
    group_size: int = opt(4, "samples per prompt (G)", lo=2)


class WindowedOptions(GroupOptions):
    shared_noise: bool = opt(False, "all G samples of a prompt start from the same noise (DanceGRPO); the group "
                             "branches at the first SDE step")
    antithetic: bool = opt(False, "with shared_noise and an even group: the group's first-SDE-step noises come in "
                           "mirrored pairs (eps, -eps), each still N(0, I), so the reward's even-order terms in "
                           "that step's action cancel out of the policy gradient")
    window: WindowOptions = Field(default_factory=WindowOptions)


def check_window(cfg, required: bool) -> None:
    """The window fits in the grid (and exists where the algorithm needs one)."""
    t, w, name = cfg.sampler.num_steps, cfg.algorithm.window, cfg.algorithm.name
    if required and w.size < 1:
        raise ConfigError(f"algorithm.window.size: {name} needs a window of at least 1 step")
    if w.size < 1:
        return
    if w.near_end == "shrink" and w.placement != "progressive":
        raise ConfigError("algorithm.window.near_end=shrink: only a progressive window moves toward the end; set "
                          "algorithm.window.placement=progressive or near_end=full")
    end = window_end(w, t)
    if w.near_end == "shrink":
        if not w.range_start < end <= t:
            raise ConfigError(f"algorithm.window.range_end: the window's range {w.range_start}..{end} is empty for "
                              f"sampler.num_steps={t}")
    elif w.size > end - (w.range_start if w.placement != "fixed" else w.start):
        raise ConfigError(f"algorithm.window.size: a window of {w.size} does not fit before step {end} of "
                          f"{t}; lower the size or raise sampler.num_steps")


def window_end(w: WindowOptions, num_steps: int) -> int:
    """The step the window stays before (``range_end``; negative counts from the end)."""
    return num_steps + w.range_end if w.range_end < 0 else w.range_end


def window_steps(w: WindowOptions, num_steps: int, iteration: int, rng: random.Random) -> tuple[int, int]:
    """``(start, stop)``: the SDE window at ``iteration`` is steps start..stop - 1 (empty when they are equal,
    which only ``near_end=shrink`` allows)."""
    start = window_start(w, num_steps, iteration, rng)
    stop = start + w.size
    return start, min(stop, window_end(w, num_steps)) if w.near_end == "shrink" else stop


def window_start(w: WindowOptions, num_steps: int, iteration: int, rng: random.Random) -> int:
    """Start index of the SDE window at ``iteration``."""
    end = window_end(w, num_steps)
    last_start = end if w.near_end == "shrink" and w.placement == "progressive" else end - w.size
    if w.placement == "fixed":
        return min(w.start, last_start)
    if w.placement == "random":
        return rng.randint(w.range_start, last_start)
    # progressive: move by `stride` every `iters_per_shift` iterations, roll back (or stay) at the end
    positions = max(last_start - w.range_start, 0) // max(w.stride, 1) + 1 if w.stride > 0 else 1
    k = iteration // w.iters_per_shift
    k = k % positions if w.roll_back else min(k, positions - 1)
    return w.range_start + k * w.stride


def check_steps(key: str, steps: list[int], t: int) -> list[int]:
    bad = [s for s in steps if not 0 <= s < t]
    if bad:
        raise ConfigError(f"{key}: steps {bad} are outside 0..{t - 1} for sampler.num_steps={t}")
    if len(set(steps)) != len(steps):
        raise ConfigError(f"{key}: steps {steps} repeat a step")
    return sorted(steps)


@dataclass
class Unit:
    """One parent state with the trained edges (children) leaving it: one transformer pass serves them all."""

    depth: int  # round of the parent (its trained edges create nodes of round depth + 1)
    parent: int
    children: list[int]  # positions in round depth + 1


@dataclass
class AlgorithmContext:
    """What an algorithm may use beyond the tree: the prompt pool, the reward set, and ODE sampling with the
    rollout grid (``sample(prompts, seeds) -> images``, for AdaGRPO's anchors)."""

    prompts: object  # flowrl.prompts.PromptSource
    rewards: Callable  # flowrl.rewards.RewardSet: (images, prompts, metadata) -> RewardScores
    sample: Callable[[list[str], list[int]], torch.Tensor]
