"""The denoising-tree rollout engine.

A :class:`~flowrl.samplers.RolloutPlan` is executed in rounds: every live node (a node above sigma_T) goes
through the transformer once per round, all of them together in as few calls as ``max_batch`` allows (the
anchors call the model once per sample and step). Nodes of one round may sit at different sigmas (side
branches that took a merged step run ahead of the main line); the transformer takes per-sample timesteps.
A parent's velocity serves all its children, so a branching step costs one evaluation per parent.

The result is a :class:`Tree`. Round r holds the nodes created by the r-th step (round 0: the roots), so
a node's round is its depth (edges from the root). Per round: latents (fp32), grid index (which sigma the
node sits at), prompt row, root id, lineage (the index where the node's side branch left the main line, -1
on the main line), parent index into the previous round, and for the edge into the node: old log-prob,
transition std, noise level, SDE flag, trained-candidate flag. Leaves are the nodes at index T, in any round.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Generator
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .samplers import RolloutPlan
from .samplers.kernels import step as kernel_step


@dataclass
class Round:
    """The nodes one round of the rollout created (round 0: the roots), each with the edge into it."""

    latents: torch.Tensor  # (N, *latent) fp32
    index: torch.Tensor  # (N,) long, grid index of the node (sigma = sigmas[index])
    group: torch.Tensor  # (N,) long, prompt row in this batch
    root: torch.Tensor  # (N,) long, id of the node's root (prompt * roots + k)
    lineage: torch.Tensor  # (N,) long, index where a side branch began; -1 = main line
    parent: torch.Tensor  # (N,) long, position in the previous round (-1 in round 0)
    log_prob: torch.Tensor  # (N,) old log-prob of the edge into the node (0 for ODE edges and roots)
    std: torch.Tensor  # (N,) full transition std of that edge (0 for ODE)
    level: torch.Tensor  # (N,) noise level the edge was drawn with
    sde: torch.Tensor  # (N,) bool, the edge is stochastic
    trained: torch.Tensor  # (N,) bool, the plan makes the edge a training candidate
    stride: torch.Tensor  # (N,) long, completion stride of a side branch (0: not completing)
    mean: torch.Tensor | None = None  # (N, *latent) sampling mean of the edge (its sample for ODE edges), kept
    # only when the rollout is asked to (an objective that normalises by the old mean)
    process_reward: torch.Tensor | None = None  # (N,) a guided plan's process reward at the edge's parent (0 on
    # unguided edges); None when the plan has no guidance
    # the rollout's transformer call that evaluated each node (an id unique within the iteration; -1: a leaf, never
    # evaluated) and the node's row in that call; None in trees the engine's driver did not build (hand-made ones)
    call: torch.Tensor | None = None  # (N,) long
    slot: torch.Tensor | None = None  # (N,) long

    @property
    def size(self) -> int:
        return self.latents.shape[0]


# the fields every node has (the sampling mean is kept only on request)
OPTIONAL_FIELDS = ("mean", "process_reward", "call", "slot")
ROUND_FIELDS = tuple(f.name for f in dataclasses.fields(Round) if f.name not in OPTIONAL_FIELDS)


@dataclass
class Tree:
    """A rollout: the grid, the plan and one :class:`Round` per round. ``tree.<field>`` (latents, index, parent,
    log_prob, ...) is the per-round list of that field, ``tree.<field>[r]`` round r's tensor."""

    sigmas: torch.Tensor  # (T+1,) the exact grid used
    rounds: list[Round]
    plan: RolloutPlan
    nfe: int = 0  # node velocity evaluations (CFG counted once)
    transformer_calls: int = 0

    def _field(self, name: str) -> list[torch.Tensor]:
        return [getattr(r, name) for r in self.rounds]

    latents = property(lambda self: self._field("latents"))
    index = property(lambda self: self._field("index"))
    group = property(lambda self: self._field("group"))
    root = property(lambda self: self._field("root"))
    lineage = property(lambda self: self._field("lineage"))
    parent = property(lambda self: self._field("parent"))
    log_prob = property(lambda self: self._field("log_prob"))
    std = property(lambda self: self._field("std"))
    level = property(lambda self: self._field("level"))
    sde = property(lambda self: self._field("sde"))
    trained = property(lambda self: self._field("trained"))
    stride = property(lambda self: self._field("stride"))
    call = property(lambda self: self._field("call"))  # per round, the rollout call that evaluated each node
    slot = property(lambda self: self._field("slot"))  # and its row in that call

    @property
    def mean(self) -> list[torch.Tensor]:
        """Per round, the edges' sampling means; empty when the rollout did not keep them."""
        return [r.mean for r in self.rounds] if self.rounds and self.rounds[0].mean is not None else []

    @classmethod
    def concat(cls, trees: list["Tree"]) -> "Tree":
        """One tree from rollouts of consecutive prompt batches under the same plan (async scoring rolls out
        batch by batch): prompt rows, root ids and parent positions are shifted past the earlier batches."""
        if len(trees) == 1:
            return trees[0]
        rounds = trees[0].num_rounds
        if any(t.num_rounds != rounds for t in trees):
            raise ValueError("Tree.concat: the trees come from different plans")
        shifted = [[] for _ in range(rounds + 1)]  # per round, each batch's Round with its indices shifted
        sizes = [0] * (rounds + 1)  # nodes per round in the batches already added
        prompts = roots = 0
        for t in trees:
            for r, rnd in enumerate(t.rounds):
                shifted[r].append(dataclasses.replace(rnd, group=rnd.group + prompts, root=rnd.root + roots,
                                                      parent=rnd.parent if r == 0 else rnd.parent + sizes[r - 1]))
            sizes = [n + rnd.size for n, rnd in zip(sizes, t.rounds)]
            prompts += int(t.rounds[0].group.max()) + 1
            roots += t.rounds[0].size
        merged = [Round(**{f: torch.cat([getattr(p, f) for p in parts]) for f in ROUND_FIELDS},
                        **{f: torch.cat([getattr(p, f) for p in parts]) if all(getattr(p, f) is not None for p in parts)
                           else None for f in OPTIONAL_FIELDS})
                  for parts in shifted]
        return cls(trees[0].sigmas, merged, trees[0].plan, nfe=sum(t.nfe for t in trees),
                   transformer_calls=sum(t.transformer_calls for t in trees))

    def to(self, device) -> "Tree":
        """The same tree with its latents (and sampling means) on ``device``; the small per-node tensors stay on
        the CPU where the rollout keeps them."""
        return dataclasses.replace(self, rounds=[dataclasses.replace(
            r, latents=r.latents.to(device), mean=None if r.mean is None else r.mean.to(device)) for r in self.rounds])

    def rollout_calls(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """The rollout's transformer calls: call id -> (rounds (n,), positions (n,)) of the nodes it evaluated, in
        the order of their rows in the call. Empty when the tree does not record its calls."""
        if not self.rounds or self.rounds[0].call is None:
            return {}
        rounds = torch.cat([torch.full_like(r.call, k) for k, r in enumerate(self.rounds)])
        positions = torch.cat([torch.arange(r.size) for r in self.rounds])
        calls, slots = torch.cat([r.call for r in self.rounds]), torch.cat([r.slot for r in self.rounds])
        evaluated = calls >= 0
        rounds, positions, calls, slots = rounds[evaluated], positions[evaluated], calls[evaluated], slots[evaluated]
        if not len(calls):
            return {}
        order = torch.argsort(calls * (1 + int(slots.max())) + slots)  # by call, then by row
        rounds, positions, calls = rounds[order], positions[order], calls[order]
        ids, counts = torch.unique_consecutive(calls, return_counts=True)
        return {int(c): (r, p) for c, r, p in zip(ids.tolist(), rounds.split(counts.tolist()),
                                                   positions.split(counts.tolist()))}

    @property
    def num_rounds(self) -> int:
        return len(self.rounds) - 1

    @property
    def num_steps(self) -> int:
        return self.plan.num_steps

    def _leaf_masks(self) -> list[torch.Tensor]:
        return [idx == self.num_steps for idx in self.index]

    def leaf_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(round, position) of every leaf, in round order then position: (L,), (L,)."""
        rounds, pos = [], []
        for r, m in enumerate(self._leaf_masks()):
            p = torch.nonzero(m).flatten()
            rounds.append(torch.full_like(p, r))
            pos.append(p)
        return torch.cat(rounds), torch.cat(pos)

    @staticmethod
    def gather(values: list[torch.Tensor], rounds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``values[rounds[k]][positions[k]]`` for every k, one indexing call per distinct round: (K, ...)."""
        first = values[0]
        out = first.new_empty((rounds.numel(), *first.shape[1:]))
        for r in rounds.unique().tolist():
            m = (rounds == r).nonzero().flatten()
            src = values[r]
            out[to_device(m, out.device)] = src[to_device(positions[m], src.device)]  # no host wait on CUDA
        return out

    def leaf_values(self, values: list[torch.Tensor]) -> torch.Tensor:
        """Per-round node values -> the leaves' values (L, ...), in :meth:`leaf_positions` order."""
        return torch.cat([v[to_device(m, v.device)] for v, m in zip(values, self._leaf_masks())])

    @property
    def leaves(self) -> torch.Tensor:
        return self.leaf_values(self.latents)  # (L, C, H, W)

    @property
    def leaf_group(self) -> torch.Tensor:
        return self.leaf_values(self.group)

    @property
    def leaf_root(self) -> torch.Tensor:
        return self.leaf_values(self.root)

    @property
    def leaf_lineage(self) -> torch.Tensor:
        return self.leaf_values(self.lineage)

    @property
    def leaf_stride(self) -> torch.Tensor:
        """Completion granularity of each leaf (0 where a side jump landed on sigma_T or on the main line)."""
        return self.leaf_values(self.stride)

    def per_node(self, leaf_values: torch.Tensor, fill: float = 0.0) -> list[torch.Tensor]:
        """Scatter (L,) leaf values into per-round tensors (non-leaves get ``fill``)."""
        out = [torch.full((x.shape[0],), fill, dtype=leaf_values.dtype) for x in self.latents]
        rounds, pos = self.leaf_positions()
        for r in rounds.unique().tolist():
            m = rounds == r
            out[r][pos[m]] = leaf_values[m]
        return out

    def node_values_from_leaves(self, leaf_values: torch.Tensor) -> list[torch.Tensor]:
        """Mean of the (finite) leaf values below each node, per round (N_r,); 0 where no finite leaf is below.
        This is BranchGRPO's uniform reward fusion and, in chains, copies each leaf's value up its path."""
        leaf_values = leaf_values.double()
        ok = torch.isfinite(leaf_values)
        sums = self.per_node(torch.where(ok, leaf_values, 0.0))
        counts = self.per_node(ok.double())
        for r in range(self.num_rounds, 0, -1):
            sums[r - 1].index_add_(0, self.parent[r], sums[r])
            counts[r - 1].index_add_(0, self.parent[r], counts[r])
        return [(s / c.clamp_min(1)).float() for s, c in zip(sums, counts)]


def velocity_batched(adapter, x: torch.Tensor, sigma: torch.Tensor, cond, rows: torch.Tensor, max_batch: int,
                     guidance_scale: float, negative) -> tuple[torch.Tensor, int]:
    """Velocities for all nodes, chunked to at most ``max_batch`` per call. Returns ((N, C, H, W), calls)."""
    outs = []
    for start in range(0, x.shape[0], max_batch):
        sl = slice(start, start + max_batch)
        outs.append(adapter.velocity(x[sl], sigma[sl], cond.index(rows[sl]), guidance_scale, negative))
    return torch.cat(outs), len(outs)


def _randn(shape, generator: torch.Generator) -> torch.Tensor:
    """Standard normal draws on the generator's own device (a CPU generator: bit-exact everywhere)."""
    return torch.randn(shape, generator=generator, device=generator.device)


def sibling_noise(shape: tuple[int, ...], branch: int, mode: str, strength: float,
                  generator: torch.Generator) -> torch.Tensor:
    """Noise for ``shape[0] = parents * branch`` children, siblings consecutive.

    ``correlated`` is BranchGRPO's marginal-preserving construction: each child's noise is N(0, I) and two
    siblings have correlation 1 / (1 + s^2). ``scaled`` multiplies independent noise by s (released code).
    ``antithetic`` mirrors: sibling b + branch/2 gets exactly minus sibling b's N(0, I) draw (each child is still
    N(0, I)), so a group's score-function gradient is a sum of differences of mirrored pairs, from which the
    reward's even-order terms in the action cancel.
    """
    if mode == "antithetic" and branch > 1:
        half = _randn((shape[0] // branch, branch // 2, *shape[1:]), generator)  # (parents, branch/2, C, H, W)
        return torch.cat([half, -half], dim=1).reshape(shape)  # siblings b and b + branch/2 mirrored
    eps = _randn(shape, generator)
    if branch == 1 or mode == "independent":
        return eps
    if mode == "scaled":
        return strength * eps
    shared = _randn((shape[0] // branch, *shape[1:]), generator).repeat_interleave(branch, dim=0)
    return (shared + strength * eps) / math.sqrt(1 + strength**2)


CALLS_PER_DRIVER = 1 << 20  # a driver whose first prompt row is a numbers its calls from a * this: unique ids


@dataclass
class _RoundWork:
    """What one round does, known from the plan alone: the tree's shape never depends on the latents, so the whole
    rollout's bookkeeping is done on the host before the first transformer call, and the round loop runs on the
    device without waiting for it (no host synchronisation per round). Positions are into the current round."""

    live: list[int]  # nodes above sigma_T: they go through the transformer, in this order
    main_index: int  # the main line's grid index this round (-1: no main-line node is live)
    branch: list[int]  # the parent of each main-line child, siblings consecutive
    side: list[int]  # the parent of each side jump
    completion: list[int]  # the parent of each completion step (ODE, on a side branch)
    completion_from: list[int]  # its grid indices: from, to
    completion_to: list[int]
    children: dict  # the next round's per-node fields (index, group, root, lineage, parent, level, sde, trained,
    # stride) as Python lists, in the order branch children, side jumps, completions


def plan_rounds(plan: RolloutPlan, roots: list[int], noise_level: float,
                row_offset: int = 0) -> tuple[dict, list[_RoundWork]]:
    """The rollout's topology, round by round, in plain Python (no tensor operation): round 0's fields and one
    :class:`_RoundWork` per round that evaluates at least one node (``row_offset``: the first prompt's row in the
    whole batch, which picks its per-prompt steps)."""
    t_steps = plan.num_steps
    n0 = sum(roots)
    cur = {"index": [0] * n0, "group": [g for g, k in enumerate(roots) for _ in range(k)], "root": list(range(n0)),
           "lineage": [-1] * n0, "parent": [-1] * n0, "level": [0.0] * n0, "sde": [False] * n0,
           "trained": [False] * n0, "stride": [0] * n0}
    first, works = cur, []
    while True:
        live = [k for k, i in enumerate(cur["index"]) if i < t_steps]
        if not live:
            return first, works
        nxt = {name: [] for name in cur}

        def add(parents, index, lineage, level, sde, trained, stride):
            nxt["parent"] += parents
            nxt["group"] += [cur["group"][p] for p in parents]
            nxt["root"] += [cur["root"][p] for p in parents]
            for name, value in (("index", index), ("lineage", lineage), ("level", level), ("sde", sde),
                                ("trained", trained), ("stride", stride)):
                nxt[name] += value if isinstance(value, list) else [value] * len(parents)

        main = [k for k in live if cur["lineage"][k] < 0]
        branch, side, main_index = [], [], -1
        if main:
            main_index = i = cur["index"][main[0]]  # the main line advances one index per round
            spec = plan.steps[i]
            level = noise_level if spec.noise_level is None else spec.noise_level
            branch = [k for k in main for _ in range(spec.branch)]
            if plan.prompt_steps:  # each prompt's own step: SDE or ODE, trained or not
                own = [plan.spec(i, cur["group"][k] + row_offset) for k in branch]
                add(branch, i + 1, -1, level, [o.sde for o in own], [o.trained for o in own], 0)
            else:
                add(branch, i + 1, -1, level, spec.sde, spec.trained, 0)
            side = [k for k in main for _ in range(spec.side)]
            add(side, i + spec.side_merge, i, level, True, True, 0)
        # side branches are completed deterministically, `stride` indices per ODE step: chains already under way
        # first, then each side child that just jumped, once per completion granularity
        comp = [k for k in live if cur["lineage"][k] >= 0]
        going = [(k, cur["stride"][k]) for k in comp if cur["stride"][k] > 0]
        fresh = [(k, g) for k in comp if cur["stride"][k] == 0
                 for g in plan.steps[cur["lineage"][k]].side_granularities]
        completion = [k for k, _ in going + fresh]
        strides = [g for _, g in going + fresh]
        c_from = [cur["index"][k] for k in completion]
        c_to = [min(i + g, t_steps) for i, g in zip(c_from, strides)]
        add(completion, c_to, [cur["lineage"][k] for k in completion], 0.0, False, False, strides)
        works.append(_RoundWork(live, main_index, branch, side, completion, c_from, c_to, nxt))
        cur = nxt


def _round_fields(fields: dict) -> dict:
    """A round's per-node fields as the CPU tensors a :class:`Round` holds."""
    return {"index": torch.tensor(fields["index"], dtype=torch.long),
            "group": torch.tensor(fields["group"], dtype=torch.long),
            "root": torch.tensor(fields["root"], dtype=torch.long),
            "lineage": torch.tensor(fields["lineage"], dtype=torch.long),
            "parent": torch.tensor(fields["parent"], dtype=torch.long),
            "level": torch.tensor(fields["level"], dtype=torch.float32),
            "sde": torch.tensor(fields["sde"], dtype=torch.bool),
            "trained": torch.tensor(fields["trained"], dtype=torch.bool),
            "stride": torch.tensor(fields["stride"], dtype=torch.long)}


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on ``device`` without making the host wait: on CUDA through pinned memory, asynchronously
    (a plain copy from pageable memory synchronises the host with the device)."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class _DeviceIndex:
    """Every round's index and sigma lists, copied to the device in one transfer per dtype, then sliced per round
    (slices of a device tensor cost no synchronisation)."""

    def __init__(self, lists: list[list], dtype: torch.dtype, device):
        flat = [v for values in lists for v in values]
        self.data = to_device(torch.tensor(flat, dtype=dtype), device)
        self.bounds, start = [], 0
        for values in lists:
            self.bounds.append((start, start + len(values)))
            start += len(values)

    def __getitem__(self, k: int) -> torch.Tensor:
        a, b = self.bounds[k]
        return self.data[a:b]


class _RoundIndex(NamedTuple):
    """One round's device index tensors: the live nodes, their prompt rows and sigmas, and the parents of each kind of
    child as positions in the round (their latents, ``*_at``) and among its live nodes (their velocities, ``*_v``)."""

    live: torch.Tensor
    rows: torch.Tensor
    branch_at: torch.Tensor
    branch_v: torch.Tensor
    side_at: torch.Tensor
    side_v: torch.Tensor
    completion_at: torch.Tensor
    completion_v: torch.Tensor
    sigma_live: torch.Tensor
    completion_from: torch.Tensor
    completion_to: torch.Tensor


def _round_indices(first: dict, works: list[_RoundWork], grid: list[float], device) -> list[_RoundIndex]:
    """Every round's :class:`_RoundIndex`, copied to the device in one transfer per dtype."""
    longs, floats = [], []
    for r, work in enumerate(works):
        here = first if r == 0 else works[r - 1].children
        among_live = {k: n for n, k in enumerate(work.live)}
        longs.append([work.live, [here["group"][k] for k in work.live], work.branch,
                      [among_live[k] for k in work.branch], work.side, [among_live[k] for k in work.side],
                      work.completion, [among_live[k] for k in work.completion]])
        floats.append([[grid[here["index"][k]] for k in work.live], [grid[i] for i in work.completion_from],
                       [grid[i] for i in work.completion_to]])
    on_longs = _DeviceIndex([v for per in longs for v in per], torch.long, device)
    on_floats = _DeviceIndex([v for per in floats for v in per], torch.float32, device)
    return [_RoundIndex(*(on_longs[8 * r + k] for k in range(8)), *(on_floats[3 * r + k] for k in range(3)))
            for r in range(len(works))]


@dataclass
class _Children:
    """A round's new nodes of one kind, on the device: (N, *latent) samples and sampling means, (N,) log-probs and
    stds of the edges into them (0 on ODE edges)."""

    sample: torch.Tensor
    log_prob: torch.Tensor
    std: torch.Tensor
    mean: torch.Tensor


@dataclass
class _Stepper:
    """How one rollout steps its nodes: the kernel and its options, the noise source and the grid."""

    plan: RolloutPlan
    grid: list[float]
    kernel: str
    noise_level: float
    generator: torch.Generator
    device: torch.device
    log_prob_reduce: str
    kernel_options: dict
    row_offset: int

    def sde(self, x, v, s, s_next, level, noise) -> _Children:
        out = kernel_step(self.kernel, x, v, s, s_next, noise_level=level, sigma_at_one=self.grid[1], noise=noise,
                          reduce=self.log_prob_reduce, **self.kernel_options)
        std = out.std.reshape(out.std.shape[0], -1)[:, 0].expand(x.shape[0]).float()
        return _Children(out.sample, out.log_prob.float(), std, out.mean)  # copied once after the last round

    def ode(self, x, v, s, s_next) -> _Children:
        xs = kernel_step("ode", x, v, s, s_next, noise_level=0.0).sample
        zeros = torch.zeros(x.shape[0], device=self.device)
        return _Children(xs, zeros, zeros, xs)

    def level(self, spec) -> float:
        return self.noise_level if spec.noise_level is None else spec.noise_level

    def main_children(self, work: _RoundWork, xp: torch.Tensor, vp: torch.Tensor):
        """The main line's children of one round from their parents' latents and velocities (siblings consecutive):
        SDE or ODE by the step spec (per child where prompts have their own steps), a guided SDE sample shifted by
        the plan's guidance. Returns (children, the guidance's process rewards or None)."""
        plan, i = self.plan, work.main_index
        spec, s, s_next = plan.steps[i], self.grid[i], self.grid[i + 1]
        level = self.level(spec)
        n = len(work.branch)
        flags = work.children["sde"][:n]
        if plan.prompt_steps is not None and len(set(flags)) > 1:
            return self._mixed(flags, xp, vp, spec, s, s_next, level), None
        if not (spec.sde if plan.prompt_steps is None else flags[0]):
            return self.ode(xp, vp, s, s_next), None
        noise = sibling_noise(tuple(xp.shape), spec.branch, spec.sibling_noise, spec.sibling_strength, self.generator)
        out = self.sde(xp, vp, s, s_next, level, to_device(noise, self.device))
        if not (spec.guided and plan.guidance is not None):
            return out, None
        # the sample moves; its log-prob is the unguided transition's
        rows = torch.tensor([work.children["group"][k] + self.row_offset for k in range(n)])
        shift, process = plan.guidance(xp, vp, s, s_next, rows)
        out.sample = out.sample + shift
        out.log_prob = kernel_step(self.kernel, xp, vp, s, s_next, noise_level=level, sigma_at_one=self.grid[1],
                                   prev_sample=out.sample, reduce=self.log_prob_reduce,
                                   **self.kernel_options).log_prob.float()
        return out, process

    def _mixed(self, flags: list[bool], xp, vp, spec, s, s_next, level) -> _Children:
        """Per-prompt steps where some prompts' step is SDE and others' ODE: the SDE children (siblings stay
        consecutive, since a prompt's parents share the flag) take the kernel's step with noise drawn for them alone,
        the rest an Euler step, each kind in one call; the results in the children's order."""
        on_host = torch.tensor(flags)
        on, off = (to_device(torch.nonzero(m).flatten(), self.device) for m in (on_host, ~on_host))
        noise = sibling_noise((int(on_host.sum()), *xp.shape[1:]), spec.branch, spec.sibling_noise,
                              spec.sibling_strength, self.generator)
        sde = self.sde(xp[on], vp[on], s, s_next, level, to_device(noise, self.device))
        ode = self.ode(xp[off], vp[off], s, s_next)
        out = _Children(sde.sample.new_empty(xp.shape), sde.log_prob.new_zeros(xp.shape[0]),
                        sde.std.new_zeros(xp.shape[0]), sde.sample.new_empty(xp.shape))
        out.sample[on], out.sample[off], out.mean[on], out.mean[off] = sde.sample, ode.sample, sde.mean, ode.sample
        out.log_prob[on], out.std[on] = sde.log_prob, sde.std
        return out

    def side_children(self, work: _RoundWork, xp: torch.Tensor, vp: torch.Tensor) -> _Children:
        """One SDE jump per side child, from the main line's index to ``side_merge`` indices on."""
        i = work.main_index
        spec = self.plan.steps[i]
        noise = to_device(_randn(tuple(xp.shape), self.generator), self.device)
        return self.sde(xp, vp, self.grid[i], self.grid[i + spec.side_merge], self.level(spec), noise)

    def completions(self, x: torch.Tensor, v: torch.Tensor, c_from: torch.Tensor, c_to: torch.Tensor) -> _Children:
        """One deterministic completion step per side-branch node, each over its own (from, to) sigmas."""
        return self.ode(x, v, c_from, c_to)


def _record_calls(tree: Tree, r: int, work: _RoundWork, calls: list[int], slots: list[int]) -> None:
    """The driver's word on which call evaluated each live node of round r, and its row there."""
    n = tree.rounds[r].size
    call, slot = [-1] * n, [-1] * n
    for k, c, q in zip(work.live, calls, slots):
        call[k], slot[k] = c, q
    tree.rounds[r].call = torch.tensor(call, dtype=torch.long)
    tree.rounds[r].slot = torch.tensor(slot, dtype=torch.long)


def _edges_to_host(tree: Tree, process_rewards: list[torch.Tensor] | None, device) -> None:
    """One device-to-host copy of every edge's log-prob and std (and process reward), not one per round."""
    sizes = [rnd.size for rnd in tree.rounds]
    none = [torch.zeros(sizes[0], device=device)]  # the roots have no edge into them
    packed = torch.cat(none + [rnd.log_prob for rnd in tree.rounds[1:]] + none + [rnd.std for rnd in tree.rounds[1:]]
                       + (none + process_rewards if process_rewards is not None else [])).cpu()
    total = sum(sizes)
    log_prob, std = packed[:total].split(sizes), packed[total: 2 * total].split(sizes)
    for rnd, lp, sd in zip(tree.rounds, log_prob, std):
        rnd.log_prob, rnd.std = lp, sd
    if process_rewards is not None:  # round 0 (the roots) has no edge, so no process reward
        for rnd, pr in zip(tree.rounds[1:], packed[2 * total + sizes[0]:].split(sizes[1:])):
            rnd.process_reward = pr


def rollout_rounds(num_prompts: int, device, plan: RolloutPlan, sigmas: torch.Tensor, latent_shape: tuple[int, ...],
                   *, kernel: str, noise_level: float, generator: torch.Generator, log_prob_reduce: str = "mean",
                   initial_noise: torch.Tensor | None = None, roots: list[int] | None = None,
                   kernel_options: dict | None = None,
                   store_mean: bool = False, row_offset: int = 0) -> Generator[tuple, torch.Tensor, Tree]:
    """The rollout of ``plan`` for ``num_prompts`` prompt rows as a generator of velocity requests: it yields
    ``(x (N, *latent), sigma (N,), rows (N,))`` for each round's live nodes, is sent their velocities (N, *latent),
    and returns the tree. :func:`rollout` drives one; :func:`packed_rollouts` drives several through shared calls.

    Noise is drawn from ``generator`` (on the generator's device) at full round size, independent of how the
    velocities are batched, so the same seed gives the same tree whatever the batching. ``initial_noise``
    (P * roots, C, H, W) overrides the root draw (used by tests, sample grids and the candidate pool). ``roots``
    gives each prompt its own number of initial noises (SuperFlow's per-prompt group sizes) instead of
    ``plan.roots_per_prompt``. ``store_mean`` keeps each edge's sampling mean in ``tree.mean`` (GRPO-Guard's ratio
    normalisation needs the old policy's mean). ``row_offset`` is this batch's first prompt row in the whole batch
    (what ``plan.guidance`` is given, and what picks a prompt's own steps).

    Each round: the live nodes' velocities are requested, then the main line's children, the side jumps and the
    side branches' completion steps are made (:class:`_Stepper`), in that order within the round. The tree's shape
    comes from the plan alone (:func:`plan_rounds`), so the host never waits for the device between rounds: the
    index lists reach the device in one copy, noise drawn on the host is copied asynchronously, and the edges'
    log-probs and stds come back in one copy after the last round.
    """
    device = torch.device(device)
    sigmas = sigmas.float().cpu()
    grid = sigmas.tolist()  # the host's copy of the (T + 1,) grid, read once
    roots = roots or [plan.roots_per_prompt] * num_prompts
    first, works = plan_rounds(plan, roots, noise_level, row_offset)
    n0 = sum(roots)
    if initial_noise is None:
        initial_noise = _randn((n0, *latent_shape), generator)
    x0 = to_device(initial_noise.float(), device)
    zeros = torch.zeros(n0)
    tree = Tree(sigmas, [Round(x0, **{**_round_fields(first), "log_prob": zeros, "std": zeros},
                               mean=x0 if store_mean else None)], plan)
    indices = _round_indices(first, works, grid, device)
    stepper = _Stepper(plan, grid, kernel, noise_level, generator, device, log_prob_reduce, kernel_options or {},
                       row_offset)
    process_rewards = [] if plan.guidance is not None else None
    for r, (work, at) in enumerate(zip(works, indices)):
        x = tree.rounds[r].latents
        sent = yield (x if len(work.live) == x.shape[0] else x[at.live]), at.sigma_live, at.rows
        v_live = sent
        if isinstance(sent, tuple):  # the driver says which call evaluated each live node, and its row there
            v_live, calls, slots = sent
            _record_calls(tree, r, work, calls, slots)
        tree.nfe += len(work.live)
        made, process = [], None  # process: the guidance's rewards of this round's main-line children (first)
        if work.branch:
            children, process = stepper.main_children(work, x[at.branch_at], v_live[at.branch_v])
            made.append(children)
        if work.side:
            made.append(stepper.side_children(work, x[at.side_at], v_live[at.side_v]))
        if work.completion:
            made.append(stepper.completions(x[at.completion_at], v_live[at.completion_v], at.completion_from,
                                            at.completion_to))
        nxt = Round(torch.cat([c.sample for c in made]), **_round_fields(work.children),
                    log_prob=torch.cat([c.log_prob for c in made]), std=torch.cat([c.std for c in made]),
                    mean=torch.cat([c.mean for c in made]) if store_mean else None)
        if tree.rounds[r].call is not None:  # nodes stay unevaluated until a later round says otherwise
            nxt.call = torch.full((nxt.size,), -1, dtype=torch.long)
            nxt.slot = torch.full((nxt.size,), -1, dtype=torch.long)
        tree.rounds.append(nxt)
        if process_rewards is not None:
            pr = torch.zeros(nxt.size, device=device)
            if process is not None:
                pr[: len(process)] = to_device(process.detach().float(), device)
            process_rewards.append(pr)
    _edges_to_host(tree, process_rewards, device)
    return tree


@torch.no_grad()
def rollout(adapter, cond, plan: RolloutPlan, sigmas: torch.Tensor, latent_shape: tuple[int, ...], *,
            max_batch: int = 64, guidance_scale: float = 1.0, negative=None, **options) -> Tree:
    """Run a plan for every prompt and return the tree of transitions.

    Each round's live nodes go through the transformer in calls of at most ``max_batch`` rows; a parent's velocity
    serves all its children.

    Args:
        adapter: the model family's :class:`~flowrl.models.base.ModelAdapter`.
        cond: the P prompts' encoded batch (``adapter.encode_prompts``).
        plan: the plan of one prompt (every prompt follows it).
        sigmas: the (T + 1,) sigma grid, sigma_0 = 1 down to sigma_T = 0.
        latent_shape: one sample's latent shape, (C, H, W) or (C, F, H, W).
        max_batch: the largest transformer call.
        guidance_scale: true CFG scale (1 = off).
        negative: the encoded negative prompt for CFG.
        **options: those of :func:`rollout_rounds`: ``kernel``, ``noise_level``, ``generator`` (required),
            ``initial_noise``, ...
    Returns:
        A :class:`Tree`: per round the nodes' latents (N_r, *latent), grid indices, parents, log-probs and stds
        of the edges into them; ``tree.leaves`` are the final states.
    """
    generator = options.pop("generator")
    return packed_rollouts(adapter, cond, [(0, cond.embeds.shape[0], generator)], plan, sigmas, latent_shape,
                           stagger=0, max_batch=max_batch, guidance_scale=guidance_scale, negative=negative,
                           **options)[0]


@torch.no_grad()
def packed_rollouts(adapter, cond, batches: list[tuple[int, int, torch.Generator]], plan: RolloutPlan,
                    sigmas: torch.Tensor, latent_shape: tuple[int, ...], *, stagger: int, max_batch: int = 64,
                    guidance_scale: float = 1.0, negative=None, on_done=None, roots: list[int] | None = None,
                    initial_noise: torch.Tensor | None = None, **options) -> list[Tree]:
    """Several prompt batches' rollouts through shared transformer calls: batch j = prompt rows [a_j, b_j) of
    ``cond`` with its own generator starts ``stagger`` rounds after batch j - 1, so its narrow first rounds fill
    the calls of the batches ahead of it at their wide rounds. Each batch's tree equals its own :func:`rollout`
    with that generator (the draws are per batch; only the batching of the velocities differs).

    ``on_done(j, tree)`` is called as soon as batch j's tree is complete (e.g. to start scoring it). Returns the
    trees in batch order; ``transformer_calls`` is shared, so each tree carries the calls of the rounds it took
    part in, divided among the batches in them by their node counts (the total is the true call count).
    ``initial_noise`` (all prompt rows' roots, *latent), prompt-major, replaces each batch's root draw with its rows'
    slice."""
    first_root = [0]  # the first root of each prompt row in ``initial_noise``
    for k in roots or [plan.roots_per_prompt] * max((b for _, b, _ in batches), default=0):
        first_root.append(first_root[-1] + k)

    def noise_of(a: int, b: int) -> torch.Tensor | None:
        return None if initial_noise is None else initial_noise[first_root[a]: first_root[b]]

    gens = [rollout_rounds(b - a, adapter.device, plan, sigmas, latent_shape, generator=g,
                           roots=roots[a:b] if roots else None, row_offset=a, initial_noise=noise_of(a, b), **options)
            for a, b, g in batches]
    trees: list[Tree | None] = [None] * len(batches)
    share = [0.0] * len(batches)
    pending: dict[int, tuple] = {}
    started, tick = 0, 0
    first_call = batches[0][0] * CALLS_PER_DRIVER if batches else 0
    while started < len(batches) or pending:
        while started < len(batches) and (started * stagger <= tick or not pending):
            pending[started] = next(gens[started])  # every plan has at least one round
            started += 1
        order = sorted(pending)
        sizes = [pending[j][0].shape[0] for j in order]
        x = torch.cat([pending[j][0] for j in order])  # (N, *latent) all pending batches' live nodes
        sig = torch.cat([pending[j][1] for j in order])
        rows = torch.cat([pending[j][2] + batches[j][0] for j in order])  # rows of the whole ``cond``
        v, calls = velocity_batched(adapter, x, sig, cond, rows, max_batch, guidance_scale, negative)
        # which call evaluated each row, and its row there: ids unique in the iteration (the first prompt row of
        # this driver's first batch tells drivers apart; calls are numbered in order)
        total = sum(sizes)
        call_of = [first_call + k // max_batch for k in range(total)]
        slot_of = [k % max_batch for k in range(total)]
        first_call += calls
        offset = 0
        for j, part, n in zip(order, v.split(sizes), sizes):
            share[j] += calls * n / total
            mine = slice(offset, offset + n)
            offset += n
            try:
                pending[j] = gens[j].send((part, call_of[mine], slot_of[mine]))
            except StopIteration as done:
                del pending[j]
                trees[j] = done.value
                trees[j].transformer_calls = round(share[j])
                if on_done is not None:
                    on_done(j, trees[j])
        tick += 1
    return trees
