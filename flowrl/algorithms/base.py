"""What every algorithm module shares: :class:`Algorithm` (the hooks every method has, with neutral defaults),
option pieces, the unit of gradient work, and the context an algorithm may use to choose prompts.

Two kinds of algorithm build on :class:`Algorithm` as siblings:
:class:`~flowrl.algorithms.transition.TransitionAlgorithm` (the loss is over the sampler's trained transitions,
through their log-probabilities) and :class:`~flowrl.algorithms.forward_process.ForwardProcessAlgorithm` (the clean samples are re-noised and the loss
is on the velocity there). A method that fits neither (reward backpropagation) subclasses :class:`Algorithm`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

import torch
from pydantic import Field

from ..advantages import group_advantages
from ..config import AlgorithmOptions, Section, opt
from ..errors import ConfigError
from ..samplers import RolloutPlan
from ..trackers import BetaTracker


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


# the per-iteration hooks in the order the trainer calls them (old_decay only where an old copy is kept)
HOOK_ORDER = ("plan", "choose_prompts", "remember_prompts", "samples_with_old_policy", "reward_advantages",
              "observe_rewards", "select_edges", "preference_pairs", "old_decay", "observe_update")


def declares(options: type, field: str) -> bool:
    """Whether an algorithm's ``Options`` class declares ``field`` (a universal check applies only then)."""
    return field in options.model_fields


class Algorithm:
    """What every algorithm has: its options, its checks, the prompts it rolls out, the rewards-to-advantages rule,
    the edges it trains, its objective and its resumable state. Each hook has a neutral default; a kind
    (:class:`~flowrl.algorithms.transition.TransitionAlgorithm`,
    :class:`~flowrl.algorithms.forward_process.ForwardProcessAlgorithm`) or a method overrides what makes it
    different.

    Per iteration the trainer calls the hooks in the order of :data:`HOOK_ORDER` (pinned by a test):

    1. :meth:`plan`: the rollout plan (a window, a tree);
    2. :meth:`choose_prompts` (the prompts, their metadata, a group size per prompt), then :meth:`remember_prompts`;
    3. :meth:`samples_with_old_policy`: whether the rollout uses the old copy of the weights;
    4. :meth:`reward_advantages` (which calls :meth:`advantages`): leaf rewards -> per-node advantages and keep
       masks; then :meth:`observe_rewards`: trackers and curricula see the rewards (after the advantages used them);
    5. :meth:`select_edges`: the edges the update trains; :meth:`preference_pairs`: (chosen, rejected) leaves for a
       preference objective;
    6. the objective from :meth:`make_objective` (made once) runs the update;
    7. :meth:`old_decay` (where an old copy is kept): how far it follows; :meth:`observe_update`: what the update
       measured.

    At config load :meth:`validate` runs the universal checks, then the kind's (:meth:`kind_checks`), then the
    method's own :meth:`check`; :meth:`check_inputs` runs once the reward set exists; :meth:`attach` once the
    policy exists; :meth:`state_dict` / :meth:`load_state_dict` carry what an exact resume needs.

    Args:
        cfg: the loaded config; ``cfg.algorithm`` is an instance of ``Options``.
    """

    Options: type = AlgorithmOptions
    keeps_old_policy = False  # True: rollouts use an old copy of the weights that follows the trained ones
    # why GRPO-Guard cannot be used with this algorithm (it normalises PPO's per-edge ratio), or None where it can
    refuses_grpo_guard: str | None = None
    # advantage settings of the published code that replace the package's where a config leaves them out
    advantage_defaults: dict = {}
    # whether the published update back-propagates through CFG's unconditional half (train.cfg_unconditional_grad
    # where a config leaves it out): Flow-GRPO's training block computes it without autograd
    cfg_unconditional_grad: bool = False
    # a documented variant of another registered algorithm subclasses it and says so here (its difference in the
    # class docstring); every other algorithm subclasses only the abstract kinds
    variant_of: type | None = None

    def __init__(self, cfg):
        self.cfg = cfg
        self.opts = cfg.algorithm
        adv = cfg.advantage
        self.tracker = (BetaTracker(adv.tracker_rho, reward_range=tuple(adv.tracker_reward_range))
                        if adv.zero_variance == "tracker" else None)
        self.last_divergence: float | None = None
        self.prompts: list[str] = []
        self.metadata: list[dict] | None = None

    # ------------------------------------------------------------------------------------------ config
    @classmethod
    def validate(cls, cfg) -> None:
        """Every check of a config for this algorithm, run at config load: :meth:`universal_checks`, the kind's
        :meth:`kind_checks`, then the algorithm's own :meth:`check`. Not to be overridden, so no override of
        :meth:`check` can skip the first two.

        Args:
            cfg: the whole loaded config (``cfg.algorithm`` holds this algorithm's options).
        Raises:
            ConfigError: one line naming the key to change.
        """
        cls.universal_checks(cfg)
        cls.kind_checks(cfg)
        cls.check(cfg)

    @classmethod
    def universal_checks(cls, cfg) -> None:
        """The checks every algorithm's config passes: GRPO-Guard only where there is a PPO ratio; a declared
        window fits the grid (and exists where the method needs one); declared mirrored noise pairs the samples of
        one shared noise in an even group."""
        a = cfg.algorithm
        if cfg.train.grpo_guard and cls.refuses_grpo_guard:
            raise ConfigError(f"train.grpo_guard: {cls.refuses_grpo_guard}; set train.grpo_guard=false")
        if declares(cls.Options, "window"):
            check_window(cfg, required=cls.window_required)
        if declares(cls.Options, "antithetic") and a.antithetic:
            if not a.shared_noise:
                raise ConfigError("algorithm.antithetic: mirrored noise pairs the samples of one shared initial "
                                  "noise; set algorithm.shared_noise=true")
            if a.group_size % 2:
                raise ConfigError(f"algorithm.antithetic: the group is split into mirrored pairs; "
                                  f"algorithm.group_size={a.group_size} must be even")

    window_required = False  # with a declared window: the method needs one of at least 1 step

    @classmethod
    def kind_checks(cls, cfg) -> None:
        """The checks of the algorithm's kind (run after the universal ones, before :meth:`check`)."""

    @classmethod
    def check(cls, cfg) -> None:
        """This algorithm's own cross-field checks, run at config load (before a model is loaded or a file written)
        after the universal and the kind's (:meth:`validate`). Overrides need not call ``super()``.

        Args:
            cfg: the whole loaded config (``cfg.algorithm`` holds this algorithm's options).
        Raises:
            ConfigError: one line naming the key to change.
        """

    def check_inputs(self, rewards, prompts=None) -> None:
        """Called once the reward set is built, before a model loads or the run folder is made: an algorithm that
        needs something outside its config (rewards that pass a gradient, a teacher checkpoint, prompt metadata)
        refuses here in one line.

        Args:
            rewards: the :class:`~rewards.registry.RewardSet`.
            prompts: the training prompts (:class:`~flowrl.prompts.PromptSource`: ``prompts`` and ``metadata``).
        """

    def reference_copies(self) -> int:
        """Copies of the trained weights this method holds as KL references besides the policy (a moving anchor,
        distillation teachers); ``flowrl memory`` counts them."""
        return 0

    def reference_checkpoints(self) -> dict[str | None, str]:
        """Run or checkpoint folders whose weights take the KL reference's place: ``{None: folder}`` for the
        reference (on-policy distillation's teacher), ``{name: folder}`` for named ones (``Policy.reference(name)``);
        empty for the starting weights. The trainer checks them before a model loads and reads them once the policy
        exists."""
        return {}

    def attach(self, policy, ctx: AlgorithmContext) -> None:
        """Called once the policy exists, before the first iteration: an algorithm that sets the KL reference
        (a teacher, a moving anchor), follows a reward's gradient or samples on its own keeps what it needs here.

        Args:
            policy: the :class:`~flowrl.policy.Policy` (trained weights, reference, old copy).
            ctx: the prompt pool, the reward set and ODE sampling (``ctx.sample.adapter`` is the model).
        """

    # ------------------------------------------------------------------------------------------ prompts
    def choose_prompts(self, ctx: AlgorithmContext, it: int, gen: torch.Generator, row: dict):
        """Which prompts this iteration rolls out, and how many samples each gets.

        Args:
            ctx: what an algorithm may call (prompt sets, ODE sampling, rewards).
            it: the iteration.
            gen: the iteration's generator (every draw comes from it, for an exact resume).
            row: the metrics row, for the algorithm's own statistics.
        Returns:
            ``(prompts, metadata, group_sizes)``: P prompts, their P metadata dicts, and the samples per prompt
            (a list of P ints) or None for the plan's own. ``drop_refill`` rolls out ``refill_extra`` more prompts
            than ``prompts_per_iter``.
        """
        adv = self.cfg.advantage
        extra = adv.refill_extra if adv.zero_variance == "drop_refill" else 0
        prompts, metadata = ctx.prompts.batch(it, self.cfg.train.prompts_per_iter + extra)
        return prompts, metadata, None

    def remember_prompts(self, prompts: list[str], metadata: list[dict] | None) -> None:
        """The trainer hands over the iteration's prompts once chosen (whichever module chose them): methods that
        score images themselves during rollout (guidance) read ``self.prompts`` / ``self.metadata``."""
        self.prompts, self.metadata = prompts, metadata

    # ------------------------------------------------------------------------------------------ plan
    def plan(self, it: int, rng: random.Random | None = None, sigmas: torch.Tensor | None = None) -> RolloutPlan:
        """The rollout plan of one prompt for this iteration: SDE or ODE, branching, side branches and trained
        steps per denoising index.

        Args:
            it: the iteration (windows and schedules move with it).
            rng: the plan's random source; default seeded by (train.seed, it).
            sigmas: the (T + 1,) sigma grid, for plans that depend on it (E-GRPO's entropy rule).
        Returns:
            A :class:`~flowrl.samplers.plans.RolloutPlan` with ``sampler.num_steps`` step specs.
        """
        raise NotImplementedError(f"{type(self).__name__} must define plan()")

    def samples_with_old_policy(self, it: int) -> bool:
        """With ``keeps_old_policy``: whether iteration ``it``'s rollout is drawn with the old weights."""
        return True

    # ------------------------------------------------------------------------------------------ advantages
    def leaf_groups(self, tree) -> torch.Tensor:
        """(L,) advantage group of every leaf: its prompt."""
        return tree.leaf_group

    def leaf_advantages(self, tree, rewards: torch.Tensor, baselines: torch.Tensor | None):
        """(L,) rewards -> (L,) advantages and statistics: the group z-score."""
        return group_advantages(rewards, self.leaf_groups(tree), self.cfg.advantage, baselines)

    def baselines(self, tree, prompts: list[str] | None) -> torch.Tensor | None:
        """(L,) the prompt tracker's value of each leaf's prompt in reward units, before this iteration."""
        if self.tracker is None or prompts is None:
            return None
        lo, hi = self.tracker.reward_range
        return torch.tensor([lo + (hi - lo) * self.tracker.value(prompts[g]) for g in tree.leaf_group.tolist()])

    def advantages(self, tree, rewards: torch.Tensor, it: int, prompts: list[str] | None = None):
        """Terminal rewards to advantages on the tree's nodes (the edge into a node carries the node's advantage).

        A node's value is the mean advantage of the leaves below it: in a flat tree each trained edge has exactly
        one leaf below.

        Args:
            tree: the rollout's :class:`~flowrl.engine.Tree` (``tree.leaf_group`` (L,) maps leaves to prompts).
            rewards: (L,) total reward per leaf (NaN already masked).
            it: the iteration.
            prompts: the P prompts, for per-prompt baselines (trackers).
        Returns:
            ``(node_adv, keep, stats)``: per round a (N_r,) advantage tensor and a (N_r,) bool keep mask (pruning),
            and a dict of statistics for the metrics row.
        """
        adv_leaf, stats = self.leaf_advantages(tree, rewards, self.baselines(tree, prompts))
        keep = [torch.ones(x.shape[0], dtype=torch.bool) for x in tree.latents]
        if self.cfg.advantage.zero_variance == "drop_refill" and prompts is not None:
            keep = [k & m for k, m in zip(keep, self._refill_masks(tree, rewards, stats))]
        return tree.node_values_from_leaves(adv_leaf), keep, stats

    def reward_advantages(self, tree, scores, weights: dict[str, float], it: int, prompts: list[str] | None = None):
        """The iteration's scores -> (per-round node advantages, keep masks, statistics). With several rewards and
        ``advantage.combine=per_reward`` (DanceGRPO's multi-reward rule), A = sum_i w_i A_i, each A_i normalised
        within its own groups from reward i alone, so a reward on a large scale cannot drown a small one; edges
        kept by every component stay kept. Otherwise the advantages of the weighted total."""
        node_adv, keep, stats = self.advantages(tree, scores.total, it, prompts)
        if self.cfg.advantage.combine != "per_reward" or len(scores.components) < 2:
            return node_adv, keep, stats
        total, keep = None, None
        for name, values in scores.components.items():
            values = torch.where(scores.invalid, torch.nan, values)  # a leaf invalid in any reward is out of all
            adv, k, _ = self.advantages(tree, values, it)
            total = [weights[name] * a for a in adv] if total is None else [t + weights[name] * a for t, a in zip(total, adv)]
            keep = k if keep is None else [x & y for x, y in zip(keep, k)]
        return total, keep, stats

    def _refill_masks(self, tree, rewards: torch.Tensor, stats: dict) -> list[torch.Tensor]:
        """drop_refill: train the first ``prompts_per_iter`` prompts whose rewards vary; the rest are dropped."""
        groups, adv = tree.leaf_group, self.cfg.advantage
        varied = []
        for g in groups.unique().tolist():
            r = rewards[(groups == g) & torch.isfinite(rewards)]
            if r.numel() > 1 and float(r.std(correction=0)) >= adv.zero_std_threshold:
                varied.append(g)
        kept = set(varied[: self.cfg.train.prompts_per_iter])
        stats["groups_dropped"] = int(groups.unique().numel()) - len(kept)
        stats["groups_refilled"] = len([g for g in kept if g >= self.cfg.train.prompts_per_iter])
        return [torch.tensor([int(g) in kept for g in grp.tolist()], dtype=torch.bool) for grp in tree.group]

    def preference_pairs(self, tree, scores) -> list[tuple[int, int]] | None:
        """(chosen, rejected) leaf indices for a preference objective (the update batch's ``pairs``); None here."""
        return None

    def observe_rewards(self, prompts: list[str], tree, rewards: torch.Tensor) -> None:
        if self.tracker is not None:
            for g, p in enumerate(prompts):
                self.tracker.update(p, rewards[tree.leaf_group == g], self.last_divergence)

    # ------------------------------------------------------------------------------------------ the update
    def select_edges(self, tree, gen: torch.Generator) -> list[torch.Tensor]:
        """Which edges the update trains.

        Args:
            tree: the rollout's tree.
            gen: the iteration's generator (for random subsets, DanceGRPO's timestep fraction).
        Returns:
            Per round, a (N_r,) bool mask over its nodes: train the edge into that node (here: the plan's
            candidates).
        """
        return [m.clone() for m in tree.trained]

    def make_objective(self, parts):
        """The objective the optimisation loop minimises for this algorithm.

        Args:
            parts: the :class:`~flowrl.objectives.TrainingParts` (policy, adapter, reference, config).
        Returns:
            An :class:`~flowrl.objectives.Objective`.
        """
        raise NotImplementedError(f"{type(self).__name__} must define make_objective()")

    def observe_update(self, stats: dict) -> None:
        """The update's statistics (absent keys: the objective did not measure them)."""
        self.last_divergence = stats.get("mean_abs_log_ratio")

    def old_decay(self, it: int) -> float:
        """With ``keeps_old_policy``: how much of the old (sampling) weights stays after iteration ``it``
        (old <- d old + (1 - d) trained)."""
        return 0.0

    # ------------------------------------------------------------------------------------------ resume
    def state_dict(self) -> dict:
        state: dict = {"last_divergence": self.last_divergence}
        if self.tracker is not None:
            state["tracker"] = self.tracker.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.last_divergence = state.get("last_divergence")
        if self.tracker is not None and "tracker" in state:
            self.tracker.load_state_dict(state["tracker"])
