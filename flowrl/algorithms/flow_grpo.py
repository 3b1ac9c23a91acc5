"""Flow-GRPO (arXiv 2505.05470): G independent initial noises per prompt, every step SDE, the first
int(T * timestep_fraction) steps trained (steps 0..8 of 10), group z-scored advantages, per-step PPO clip.

This class is also the default of every hook: each other algorithm module subclasses it and overrides only
what makes it different. The hooks, in the order the trainer calls them each iteration:

1. :meth:`choose_prompts`: the iteration's prompts, their metadata and (optionally) a group size per prompt;
2. :meth:`plan`: the rollout plan (per denoising step: SDE or ODE, branching, side branches, trained);
3. :meth:`advantages`: leaf rewards -> per-node (edge) advantages and keep masks (pruning);
4. :meth:`observe_rewards`: trackers and curricula see the rewards (after the advantages used them);
5. :meth:`select_edges`: which candidate edges are trained this iteration;
6. :meth:`work_items` / :meth:`item_rows` / :meth:`loss_rows`: the unit of gradient work and how per-edge
   log-ratios become loss rows (per step here; per chunk in Chunk-GRPO); :meth:`loss_weights`: per-step weights;
7. :meth:`observe_update`: what the update measured (SPO's KL-adaptive forgetting uses it);
plus :meth:`check` (cross-field checks at config load) and :meth:`state_dict` for exact resume.
"""

from __future__ import annotations

import random

import torch

from ..advantages import group_advantages
from ..config import opt
from ..errors import ConfigError
from ..objectives import TransitionObjective
from ..samplers import RolloutPlan, StepSpec
from ..trackers import BetaTracker
from .base import AlgorithmContext, Unit, WindowedOptions, check_window, window_steps


class FlowGRPOOptions(WindowedOptions):
    timestep_fraction: float = opt(0.99, "the first int(T * f) steps are trained (without a window)", lo=0.0, hi=1.0,
                                   lo_open=True)


class FlowGRPO:
    """Flow-GRPO, and the default of every hook an algorithm has.

    Each other algorithm subclasses it with exactly its difference. Per iteration the trainer calls
    :meth:`choose_prompts`, :meth:`plan` (through the rollout runner), :meth:`advantages`,
    :meth:`observe_rewards`, :meth:`select_edges`, :meth:`work_items` and the objective from
    :meth:`make_objective`, then :meth:`observe_update`. ``Options`` is the pydantic model of the config's
    ``algorithm`` section; :meth:`check` runs when a config loads; :meth:`state_dict` /
    :meth:`load_state_dict` carry what an exact resume needs.

    Args:
        cfg: the loaded config; ``cfg.algorithm`` is an instance of ``Options``.
    """

    Options = FlowGRPOOptions
    window_required = False
    keeps_old_policy = False  # True: rollouts use an old copy of the weights that follows the trained ones
    per_edge_rows = True  # loss_rows keeps one row per edge (so train.fused_loss can clip per edge)
    # why GRPO-Guard cannot be used with this algorithm (it normalises PPO's per-edge ratio), or None where it can
    refuses_grpo_guard: str | None = None
    # advantage settings of the published code that replace the package's where a config leaves them out
    advantage_defaults: dict = {}

    def __init__(self, cfg):
        self.cfg = cfg
        self.opts = cfg.algorithm
        adv = cfg.advantage
        self.tracker = (BetaTracker(adv.tracker_rho, reward_range=tuple(adv.tracker_reward_range))
                        if adv.zero_variance == "tracker" else None)
        self.last_divergence: float | None = None

    # ------------------------------------------------------------------------------------------ config
    @classmethod
    def check_grpo_guard(cls, cfg) -> None:
        """One line when ``train.grpo_guard`` is on for an algorithm whose update has no PPO ratio to normalise."""
        if cfg.train.grpo_guard and cls.refuses_grpo_guard:
            raise ConfigError(f"train.grpo_guard: {cls.refuses_grpo_guard}; set train.grpo_guard=false")

    @classmethod
    def validate(cls, cfg) -> None:
        """Every check of a config for this algorithm, run at config load: the universal ones first (here, where no
        subclass's :meth:`check` can skip them), then the algorithm's own. Not to be overridden.

        Args:
            cfg: the whole loaded config (``cfg.algorithm`` holds this algorithm's options).
        Raises:
            ConfigError: one line naming the key to change.
        """
        cls.check_grpo_guard(cfg)
        cls.check(cfg)

    @classmethod
    def check(cls, cfg) -> None:
        """This algorithm's own cross-field checks, run at config load (before a model is loaded or a file written)
        after the universal ones (:meth:`validate`).

        Args:
            cfg: the whole loaded config (``cfg.algorithm`` holds this algorithm's options).
        Raises:
            ConfigError: one line naming the key to change.
        """
        check_window(cfg, required=cls.window_required)
        a = cfg.algorithm
        if getattr(a, "antithetic", False):
            if not getattr(a, "shared_noise", False):
                raise ConfigError("algorithm.antithetic: mirrored noise pairs the samples of one shared initial "
                                  "noise; set algorithm.shared_noise=true")
            if a.group_size % 2:
                raise ConfigError(f"algorithm.antithetic: the group is split into mirrored pairs; "
                                  f"algorithm.group_size={a.group_size} must be even")

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
        score images themselves during rollout or update (guidance, reward backpropagation) read
        ``self.prompts`` / ``self.metadata``."""
        self.prompts, self.metadata = prompts, metadata

    # ------------------------------------------------------------------------------------------ plan
    def trained_steps(self, t: int) -> list[bool]:
        """Training candidates without a window: Flow-GRPO's first int(T * f) steps."""
        n_train = max(1, min(int(t * self.opts.timestep_fraction), t))
        return [i < n_train for i in range(t)]

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
        t, o = self.cfg.sampler.num_steps, self.opts
        rng = rng or random.Random(self.cfg.train.seed * 1000003 + it)
        if o.window.size == 0:
            sde, trained, notes = [True] * t, self.trained_steps(t), {}
        else:  # hybrid ODE-SDE sampling: SDE and training only inside the window
            start, stop = window_steps(o.window, t, it, rng)
            sde = [start <= i < stop for i in range(t)]
            trained, notes = list(sde), {"window_start": start}
        steps = [StepSpec(sde=s, trained=tr) for s, tr in zip(sde, trained)]
        roots, shared = self.group()
        if shared and not any(sde):  # an empty window (MixGRPO's last position): one ODE sample, nothing trained
            roots = 1
        elif shared:  # one root per prompt that branches G ways at the first SDE step
            first_sde = steps[sde.index(True)]
            first_sde.branch = roots
            if getattr(o, "antithetic", False):  # only the windowed options have it (SuperFlow's do not)
                first_sde.sibling_noise = "antithetic"
            roots = 1
        return RolloutPlan(steps, roots_per_prompt=roots, notes=notes)

    def group(self) -> tuple[int, bool]:
        """(samples per prompt in the plan, whether they share one initial noise)."""
        return self.opts.group_size, self.opts.shared_noise

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

    def observe_rewards(self, prompts: list[str], tree, rewards: torch.Tensor) -> None:
        if self.tracker is not None:
            for g, p in enumerate(prompts):
                self.tracker.update(p, rewards[tree.leaf_group == g], self.last_divergence)

    # ------------------------------------------------------------------------------------------ edges
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

    def work_items(self, tree, node_adv, masks, gen: torch.Generator) -> list[list[Unit]]:
        """Group the trained edges into work items, the unit the update's micro-batches are made of.

        One item per parent state with all its trained edges. Edges with zero advantage carry no policy gradient
        and are skipped unless a KL term needs them.

        Args:
            tree: the rollout's tree.
            node_adv: per round, (N_r,) advantages.
            masks: per round, (N_r,) bool masks of the edges to train.
            gen: the iteration's generator.
        Returns:
            Per minibatch-able group, a list of :class:`~flowrl.algorithms.base.Unit` items.
        """
        keep_zero = self.cfg.train.kl_beta > 0
        items = []
        for d in range(1, tree.num_rounds + 1):
            sel = masks[d] if keep_zero else masks[d] & (node_adv[d] != 0)
            children = torch.nonzero(sel).flatten()
            by_parent: dict[int, list[int]] = {}
            for c, p in zip(children.tolist(), tree.parent[d][children].tolist()):
                by_parent.setdefault(p, []).append(c)
            items += [[Unit(d - 1, p, cs)] for p, cs in by_parent.items()]
        return items

    def item_rows(self, item: list[Unit]) -> int:
        """Loss rows an item contributes (the loss is their mean over the minibatch)."""
        return sum(len(u.children) for u in item)

    def loss_rows(self, items: list[list[Unit]], log_prob, old_log_prob, adv, kl, step):
        """Per-edge (E,) terms of a micro-batch of items -> per-row (log-ratio, advantage, kl, step index)."""
        return log_prob - old_log_prob, adv, kl, step

    def loss_weights(self, tree, masks) -> dict[int, float] | None:
        """A loss weight per denoising step.

        Args:
            tree: the rollout's tree.
            masks: per round, the (N_r,) trained-edge masks.
        Returns:
            ``{grid index of the parent: weight}``, or None for a weight of 1 everywhere.
        """
        return None

    def make_objective(self, parts):
        """The objective the optimisation loop minimises for this algorithm.

        Args:
            parts: the :class:`~flowrl.objectives.TrainingParts` (policy, adapter, reference, config).
        Returns:
            An :class:`~flowrl.objectives.Objective`; here :class:`~flowrl.objectives.TransitionObjective`
            (PPO-clip on the rollout's transitions).
        """
        return TransitionObjective(self, parts)

    def old_decay(self, it: int) -> float:
        """With ``keeps_old_policy``: how much of the old (sampling) weights stays after iteration ``it``
        (old <- d old + (1 - d) trained)."""
        return 0.0

    def preference_pairs(self, tree, scores) -> list[tuple[int, int]] | None:
        """(chosen, rejected) leaf indices for a preference objective (the update batch's ``pairs``); None here."""
        return None

    def samples_with_old_policy(self, it: int) -> bool:
        """With ``keeps_old_policy``: whether iteration ``it``'s rollout is drawn with the old weights."""
        return True

    def observe_update(self, stats: dict) -> None:
        self.last_divergence = stats.get("mean_abs_log_ratio")

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
