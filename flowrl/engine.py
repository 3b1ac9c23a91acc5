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

from collections.abc import Generator

import dataclasses
import math
from dataclasses import dataclass

import torch

from .samplers import RolloutPlan, StepSpec
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

    @property
    def size(self) -> int:
        return self.latents.shape[0]


# the fields every node has (the sampling mean is kept only on request)
ROUND_FIELDS = tuple(f.name for f in dataclasses.fields(Round) if f.name not in ("mean", "process_reward"))


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

    @property
    def mean(self) -> list[torch.Tensor]:
        """Per round, the edges' sampling means; empty when the rollout did not keep them."""
        return [r.mean for r in self.rounds] if self.rounds and self.rounds[0].mean is not None else []

    @classmethod
    def skeleton(cls, parents: list[list[int]], log_probs: list[list[float]] | None = None,
                 groups: list[int] | None = None) -> "Tree":
        """A latent-free tree from its structure, for hand-computed checks: ``parents[r - 1]`` lists the parent
        (position in round r - 1) of every node of round r; every node of the last round is a leaf; all edges
        are SDE and trained. ``groups`` gives each root's prompt row (default: all 0)."""
        n0 = len(groups) if groups else 1 + max(parents[0], default=0)
        t = len(parents)
        lps = [[0.0] * n0] + (log_probs or [[0.0] * len(p) for p in parents])
        rounds = []
        for r, par in enumerate([[-1] * n0] + parents):
            k = len(par)
            par = torch.tensor(par)
            root = torch.arange(n0) if r == 0 else rounds[r - 1].root[par]
            group = torch.tensor(groups or [0] * n0) if r == 0 else rounds[r - 1].group[par]
            rounds.append(Round(torch.zeros(k, 1), torch.full((k,), r), group, root, torch.full((k,), -1), par,
                                torch.tensor(lps[r], dtype=torch.float32), torch.zeros(k), torch.zeros(k),
                                torch.ones(k, dtype=torch.bool), torch.ones(k, dtype=torch.bool),
                                torch.zeros(k, dtype=torch.long)))
        return cls(torch.linspace(1, 0, t + 1), rounds, RolloutPlan([StepSpec() for _ in range(t)], roots_per_prompt=n0))

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
                        mean=torch.cat([p.mean for p in parts]) if parts[0].mean is not None else None,
                        process_reward=(torch.cat([p.process_reward for p in parts])
                                        if parts[0].process_reward is not None else None))
                  for parts in shifted]
        return cls(trees[0].sigmas, merged, trees[0].plan, nfe=sum(t.nfe for t in trees),
                   transformer_calls=sum(t.transformer_calls for t in trees))

    def to(self, device) -> "Tree":
        """The same tree with its latents (and sampling means) on ``device``; the small per-node tensors stay on
        the CPU where the rollout keeps them."""
        return dataclasses.replace(self, rounds=[dataclasses.replace(
            r, latents=r.latents.to(device), mean=None if r.mean is None else r.mean.to(device)) for r in self.rounds])

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
            out[m.to(out.device)] = src[positions[m].to(src.device)]
        return out

    def leaf_values(self, values: list[torch.Tensor]) -> torch.Tensor:
        """Per-round node values -> the leaves' values (L, ...), in :meth:`leaf_positions` order."""
        return torch.cat([v[m.to(v.device)] for v, m in zip(values, self._leaf_masks())])

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
    outs, calls = [], 0
    for start in range(0, x.shape[0], max_batch):
        sl = slice(start, start + max_batch)
        outs.append(adapter.velocity(x[sl], sigma[sl], cond.index(rows[sl]), guidance_scale, negative))
        calls += 1
    return torch.cat(outs), calls


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
    (P * roots, C, H, W) overrides the root draw (used by tests and sample grids). ``roots`` gives each prompt its
    own number of initial noises (SuperFlow's per-prompt group sizes) instead of ``plan.roots_per_prompt``. ``store_mean`` keeps each
    edge's sampling mean in ``tree.mean`` (GRPO-Guard's ratio normalisation needs the old policy's mean).
    ``row_offset`` is this batch's first prompt row in the whole batch (what ``plan.guidance`` is given).
    """
    t_steps = plan.num_steps
    sigmas = sigmas.float().cpu()
    sigma_at_one = float(sigmas[1])
    roots = roots or [plan.roots_per_prompt] * num_prompts
    n0 = sum(roots)
    if initial_noise is None:
        initial_noise = _randn((n0, *latent_shape), generator)
    zeros, no = torch.zeros(n0), torch.zeros(n0, dtype=torch.bool)
    x0 = initial_noise.float().to(device)
    tree = Tree(sigmas, [Round(x0, torch.zeros(n0, dtype=torch.long),
                               torch.arange(num_prompts).repeat_interleave(torch.tensor(roots)), torch.arange(n0),
                               torch.full((n0,), -1), torch.full((n0,), -1), zeros, zeros, zeros, no, no,
                               torch.zeros(n0, dtype=torch.long), x0 if store_mean else None)], plan)

    def sde_step(x, v, s, s_next, level, noise):
        out = kernel_step(kernel, x, v, s, s_next, noise_level=level, sigma_at_one=sigma_at_one, noise=noise,
                          reduce=log_prob_reduce, **(kernel_options or {}))
        std = out.std.reshape(out.std.shape[0], -1)[:, 0].expand(x.shape[0]).float()
        return out.sample, out.log_prob.float(), std, out.mean  # on the device: copied once after the last round

    r = 0
    while True:
        cur = tree.rounds[r]
        x, idx, lineage = cur.latents, cur.index, cur.lineage
        live = torch.nonzero(idx < t_steps).flatten()
        if live.numel() == 0:
            break
        sig = sigmas[idx[live]]
        v_live = yield x[live.to(device)], sig.to(device), cur.group[live].to(device)
        tree.nfe += live.numel()
        v = torch.zeros_like(x)
        v[live.to(device)] = v_live
        parts: list[_Edges] = []  # this round's new nodes: main-line children, side jumps, completions
        process = None  # the guidance's process rewards of this round's main-line children (first in parts)
        main = live[lineage[live] < 0]
        if main.numel():
            i = int(idx[main[0]])  # the main line advances one index per round
            spec = plan.steps[i]
            s, s_next = float(sigmas[i]), float(sigmas[i + 1])
            level = noise_level if spec.noise_level is None else spec.noise_level
            if spec.branch:
                par = main.repeat_interleave(spec.branch)
                xp, vp = x[par.to(device)], v[par.to(device)]
                n = par.numel()
                if spec.sde:
                    noise = sibling_noise(tuple(xp.shape), spec.branch, spec.sibling_noise, spec.sibling_strength, generator)
                    xs, lp, sd, mean = sde_step(xp, vp, s, s_next, level, noise.to(device))
                    if spec.guided and plan.guidance is not None:  # the sample moves; its log-prob is the unguided one's
                        shift, process = plan.guidance(xp, vp, s, s_next, cur.group[par] + row_offset)
                        xs = xs + shift
                        lp = kernel_step(kernel, xp, vp, s, s_next, noise_level=level, sigma_at_one=sigma_at_one,
                                         prev_sample=xs, reduce=log_prob_reduce,
                                         **(kernel_options or {})).log_prob.float()
                else:
                    xs = kernel_step("ode", xp, vp, s, s_next, noise_level=0.0).sample
                    lp = sd = torch.zeros(n, device=device)
                    mean = xs
                parts.append(_Edges(par, xs, torch.full((n,), i + 1), torch.full((n,), -1), lp, sd,
                                    torch.full((n,), level), torch.full((n,), spec.sde), torch.full((n,), spec.trained),
                                    torch.zeros(n), mean))
            if spec.side:
                par = main.repeat_interleave(spec.side)
                xp, vp = x[par.to(device)], v[par.to(device)]
                n, target = par.numel(), i + spec.side_merge
                noise = _randn(tuple(xp.shape), generator).to(device)
                xs, lp, sd, mean = sde_step(xp, vp, s, float(sigmas[target]), level, noise)
                parts.append(_Edges(par, xs, torch.full((n,), target), torch.full((n,), i), lp, sd,
                                    torch.full((n,), level), torch.ones(n, dtype=torch.bool),
                                    torch.ones(n, dtype=torch.bool), torch.zeros(n), mean))
        comp = live[lineage[live] >= 0]
        if comp.numel():  # side branches are completed deterministically, `stride` indices per ODE step
            stride = cur.stride[comp]
            fresh = comp[stride == 0]  # side children that just jumped: one completion chain per granularity
            grans = [plan.steps[int(i)].side_granularities for i in lineage[fresh].tolist()]
            par = torch.cat([comp[stride > 0]] + [c.repeat(len(g)) for c, g in zip(fresh, grans)])
            step_len = torch.cat([stride[stride > 0]] + [torch.tensor(g) for g in grans]).long()
            ci = idx[par]
            cn = torch.minimum(ci + step_len, torch.tensor(t_steps))
            xs = kernel_step("ode", x[par.to(device)], v[par.to(device)], sigmas[ci], sigmas[cn], noise_level=0.0).sample
            n = par.numel()
            zeros_dev = torch.zeros(n, device=device)
            parts.append(_Edges(par, xs, cn, lineage[par], zeros_dev, zeros_dev, torch.zeros(n),
                                torch.zeros(n, dtype=torch.bool), torch.zeros(n, dtype=torch.bool), step_len, xs))
        tree.rounds.append(_Edges.join(parts, cur, store_mean))
        if plan.guidance is not None:
            pr = torch.zeros(tree.rounds[-1].size)
            if process is not None:
                pr[: len(process)] = process.detach().float().cpu()
            tree.rounds[-1].process_reward = pr
        r += 1
    # one device-to-host copy of the edges' log-probs and stds, not one synchronisation per round
    for rnd in tree.rounds:
        rnd.log_prob, rnd.std = rnd.log_prob.float().cpu(), rnd.std.float().cpu()
    return tree


@dataclass
class _Edges:
    """Nodes of the next round made one way (main-line children, side jumps or completions), before they are
    joined into a :class:`Round`; tensors of length n on the CPU or the device."""

    parent: torch.Tensor  # (n,) positions in the current round
    latents: torch.Tensor  # (n, *latent)
    index: torch.Tensor
    lineage: torch.Tensor
    log_prob: torch.Tensor
    std: torch.Tensor
    level: torch.Tensor
    sde: torch.Tensor
    trained: torch.Tensor
    stride: torch.Tensor
    mean: torch.Tensor  # (n, *latent)

    @staticmethod
    def join(parts: list["_Edges"], previous: Round, store_mean: bool) -> Round:
        par = torch.cat([p.parent for p in parts])

        def cat(name):
            return torch.cat([getattr(p, name) for p in parts])

        return Round(cat("latents"), cat("index").long(), previous.group[par], previous.root[par],
                     cat("lineage").long(), par, cat("log_prob"), cat("std"), cat("level").float(), cat("sde"),
                     cat("trained"), cat("stride").long(), cat("mean") if store_mean else None)


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
                    **options) -> list[Tree]:
    """Several prompt batches' rollouts through shared transformer calls: batch j = prompt rows [a_j, b_j) of
    ``cond`` with its own generator starts ``stagger`` rounds after batch j - 1, so its narrow first rounds fill
    the calls of the batches ahead of it at their wide rounds. Each batch's tree equals its own :func:`rollout`
    with that generator (the draws are per batch; only the batching of the velocities differs).

    ``on_done(j, tree)`` is called as soon as batch j's tree is complete (e.g. to start scoring it). Returns the
    trees in batch order; ``transformer_calls`` is shared, so each tree carries the calls of the rounds it took
    part in, divided among the batches in them by their node counts (the total is the true call count)."""
    gens = [rollout_rounds(b - a, adapter.device, plan, sigmas, latent_shape, generator=g,
                           roots=roots[a:b] if roots else None, row_offset=a, **options) for a, b, g in batches]
    trees: list[Tree | None] = [None] * len(batches)
    share = [0.0] * len(batches)
    pending: dict[int, tuple] = {}
    started, tick = 0, 0
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
        for j, part, n in zip(order, v.split(sizes), sizes):
            share[j] += calls * n / sum(sizes)
            try:
                pending[j] = gens[j].send(part)
            except StopIteration as done:
                del pending[j]
                trees[j] = done.value
                trees[j].transformer_calls = round(share[j])
                if on_done is not None:
                    on_done(j, trees[j])
        tick += 1
    return trees
