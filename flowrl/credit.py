"""Ground-truth step credit: how close is each algorithm's per-transition advantage to the true one?

For a transition the rollout trains, from state x_t (a node at grid index i) to action x_{t-1} (its child at index
j), the true advantage is ``Q(x_t, x_{t-1}) - V(x_t)``: the expected terminal reward after taking that action,
less the expected reward from the state under the rollout's own sampler. ``Q(x_t, x_{t-1})`` is the value of the
child state, so both are values of nodes, each estimated by Monte Carlo: the mean reward of M continuations that
follow the plan from the node to sigma = 0 (the plan's SDE steps draw noise, its ODE steps are deterministic, the
same guidance scale), or, for a one-step side branch, its own jump then the plan's deterministic completion.

Variance reduction (the truth's spread within a group is about the size of the error of 8 independent
continuations on the tiny model):

- **Common random numbers.** Continuation k of every node of one prompt draws its step-i noise from one table
  ``noise[prompt, k, i]``, so ``V(child) - V(parent)`` is the mean of M *paired* differences: the child's
  continuation k and the parent's share every draw after the action, and only the action itself differs.
- **Antithetic draws.** Continuations k and k + M/2 use exactly opposite noise (each still N(0, I)), which
  cancels the reward's odd-order terms in the noise from the mean.
- **Deterministic continuations are run once**: a node whose remaining plan is ODE has an exact value.

The standard error of each truth is the standard error of its M paired differences (antithetic pairs averaged
first, so pairs count as one draw each). What this module compares is the algorithm's advantage times its
per-step loss weight (where it has one) with the truth, over the trained transitions of one rollout of the same
prompts and initial noise: Pearson and Spearman correlation, sign agreement (over transitions whose truth is
more than two standard errors from 0), the share of the truth's variance explained (the squared Pearson
correlation), and per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from .report.correlation import pearson, spearman

# one continuation step: (from grid index, to grid index, stochastic, noise level)
Step = tuple[int, int, bool, float]
# stepper(x (N, *latent), rows (N,) prompt rows, sigma_from (N,), sigma_to (N,), sde (N,) bool, level (N,),
#         noise (N, *latent)) -> next x (N, *latent); velocities and kernels live behind it
Stepper = Callable[..., torch.Tensor]


@dataclass
class Transition:
    """One trained transition of a rollout, with what the algorithm assigned it."""

    round: int  # the child's round in the tree
    child: int  # the child's position in its round
    parent: int  # the parent's position in round - 1
    step: int  # the parent's grid index (the denoising step the action was taken at)
    prompt: int  # prompt row
    assigned: float  # the algorithm's advantage (times its loss weight for the step)


@dataclass
class Truth:
    value: torch.Tensor  # (E,) float64 Monte Carlo Q - V
    se: torch.Tensor  # (E,) its standard error
    evaluations: int  # transformer evaluations the continuations cost


def noise_table(prompts: int, draws: int, steps: int, latent_shape: tuple[int, ...], seed: int,
                antithetic: bool = True) -> torch.Tensor:
    """(P, M, T, *latent) standard normal draws for the continuations; with ``antithetic`` draw k + M/2 is minus
    draw k (M even)."""
    gen = torch.Generator().manual_seed(seed)
    if antithetic:
        if draws % 2:
            raise ValueError(f"antithetic continuations come in pairs; give an even number, not {draws}")
        half = torch.randn((prompts, draws // 2, steps, *latent_shape), generator=gen)
        return torch.cat([half, -half], dim=1)
    return torch.randn((prompts, draws, steps, *latent_shape), generator=gen)


def run_continuations(stepper: Stepper, starts: torch.Tensor, rows: torch.Tensor, draws: torch.Tensor,
                      programs: list[list[Step]], sigmas: torch.Tensor, noise: torch.Tensor,
                      on_step: Callable[[int], None] | None = None) -> tuple[torch.Tensor, int]:
    """Run every job to sigma = 0: job n starts at ``starts[n]`` (*latent) for prompt row ``rows[n]`` and draws its
    noise from ``noise[rows[n], draws[n], step]``, following ``programs[n]``. All jobs advance one step of their
    program per pass, together (the transformer takes a sigma per row). Returns ((N, *latent) ends, evaluations)."""
    x = starts.clone()
    longest = max((len(p) for p in programs), default=0)
    evaluations = 0
    for s in range(longest):
        active = [n for n, p in enumerate(programs) if len(p) > s]
        idx = torch.tensor(active, dtype=torch.long)
        frm = torch.tensor([programs[n][s][0] for n in active])
        to = torch.tensor([programs[n][s][1] for n in active])
        sde = torch.tensor([programs[n][s][2] for n in active])
        level = torch.tensor([programs[n][s][3] for n in active], dtype=torch.float32)
        eps = noise[rows[idx], draws[idx], frm]
        x[idx] = stepper(x[idx], rows[idx], sigmas[frm], sigmas[to], sde, level, eps)
        evaluations += len(active)
        if on_step is not None:
            on_step(len(active))
    return x, evaluations


def node_program(plan, index: int, lineage: int, side_stride: int, noise_level: float, row: int = 0) -> list[Step]:
    """What follows a node under the rollout's plan (prompt row ``row``'s steps where the plan has per-prompt ones):
    the main line's steps from its index (each step's own noise level, else ``noise_level``); a node on a side
    branch: deterministic completion in strides of ``side_stride``."""
    t = plan.num_steps
    if lineage < 0:
        specs = [plan.spec(i, row) for i in range(index, t)]
        return [(i, i + 1, bool(sp.sde), float(noise_level if sp.noise_level is None else sp.noise_level)
                 if sp.sde else 0.0) for i, sp in zip(range(index, t), specs)]
    out, i = [], index
    while i < t:
        nxt = min(i + max(side_stride, 1), t)
        out.append((i, nxt, False, 0.0))
        i = nxt
    return out


def true_advantages(tree, transitions: list[Transition], stepper: Stepper,
                    reward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], noise: torch.Tensor,
                    noise_level: float, progress: Callable[[int], None] | None = None) -> Truth:
    """Monte Carlo ``Q(x_t, x_{t-1}) - V(x_t)`` of each transition (see the module's text).

    Args:
        tree: the rollout (its plan, latents, grid indices, lineages and the level of each edge).
        transitions: the trained transitions.
        stepper: one continuation step for a batch (velocity + the rollout's kernel).
        reward: (final latents (N, *latent), prompt rows (N,)) -> (N,) rewards.
        noise: (P, M, T, *latent) continuation noise (:func:`noise_table`).
        noise_level: the sampler's level, for steps whose plan gives none.
    """
    plan, sigmas = tree.plan, tree.sigmas
    draws = noise.shape[1]

    def program(r: int, n: int) -> list[Step]:
        lin = int(tree.lineage[r][n])
        return node_program(plan, int(tree.index[r][n]), lin, _stride(plan, lin), noise_level, int(tree.group[r][n]))

    def via_edge(r: int, n: int, cr: int, c: int) -> list[Step]:
        """The parent's value through the edge's own kind of action (a side jump spans several indices at its own
        level), then what follows the child."""
        first = (int(tree.index[r][n]), int(tree.index[cr][c]), True, float(tree.level[cr][c]))
        return [first] + program(cr, c)

    # every value to estimate: key -> (round, node, program); a side edge's parent is valued through the edge
    values: dict[tuple, tuple[int, int, list[Step]]] = {}
    pairs = []
    for e in transitions:
        child_key = ("node", e.round, e.child)
        values.setdefault(child_key, (e.round, e.child, program(e.round, e.child)))
        side = int(tree.lineage[e.round][e.child]) >= 0
        parent_key = ("via", e.round, e.child) if side else ("node", e.round - 1, e.parent)
        if parent_key not in values:
            values[parent_key] = (e.round - 1, e.parent, via_edge(e.round - 1, e.parent, e.round, e.child)
                                  if side else program(e.round - 1, e.parent))
        pairs.append((child_key, parent_key))
    keys = list(values)
    starts, rows, ks, programs, owner = [], [], [], [], []
    for key in keys:
        r, n, prog = values[key]
        stochastic = any(s for _, _, s, _ in prog)
        for k in range(draws if stochastic else 1):  # a deterministic continuation is exact: run once
            starts.append(tree.latents[r][n].cpu())
            rows.append(int(tree.group[r][n]))
            ks.append(k)
            programs.append(prog)
            owner.append(key)
    ends, evaluations = run_continuations(stepper, torch.stack(starts), torch.tensor(rows), torch.tensor(ks), programs,
                                          sigmas.cpu(), noise, progress)
    scores = reward(ends, torch.tensor(rows)).double()  # (jobs,)
    per_key: dict[tuple, torch.Tensor] = {}
    by_key: dict[tuple, list[float]] = {key: [] for key in keys}
    for key, s in zip(owner, scores.tolist()):
        by_key[key].append(s)
    for key in keys:
        v = torch.tensor(by_key[key], dtype=torch.float64)
        per_key[key] = v.expand(draws) if v.numel() == 1 else v  # (M,) per continuation draw
    diffs = torch.stack([per_key[c] - per_key[p] for c, p in pairs]) if pairs else torch.zeros(0, draws)  # (E, M)
    value = diffs.mean(1)
    # antithetic pairs (k, k + M/2) are one draw each: the SE of the means of the pairs
    half = draws // 2
    paired = 0.5 * (diffs[:, :half] + diffs[:, half:]) if draws % 2 == 0 and draws >= 4 else diffs
    m = paired.shape[1]
    se = paired.std(1, correction=1) / math.sqrt(m) if m > 1 else torch.zeros_like(value)
    return Truth(value, se, evaluations)


def _stride(plan, lineage: int) -> int:
    if lineage < 0:
        return 1
    grans = plan.steps[lineage].side_granularities
    return int(grans[0]) if grans else plan.num_steps


# ----------------------------------------------------------------------------------------- comparing
@dataclass
class Agreement:
    transitions: int
    pearson: float
    spearman: float
    sign: float  # share of transitions with a clear truth (|truth| > 2 SE) whose assigned sign matches
    explained: float  # share of the truth's variance a linear fit of the assigned advantage explains
    truth_std: float  # spread of the truth
    truth_se: float  # root-mean-square standard error of the truth
    per_step: dict = field(default_factory=dict)  # step -> {"transitions", "pearson", "truth_std", "truth_se"}
    pearson_ci: tuple[float, float] = (float("nan"), float("nan"))  # 95% bootstrap interval over transitions


def agreement(assigned: torch.Tensor, truth: torch.Tensor, se: torch.Tensor, steps: torch.Tensor) -> Agreement:
    """How far the assigned advantages (E,) follow the truth (E,) with standard errors (E,), overall and per step."""
    def summary(a, t, s):
        r = pearson(a, t)
        clear = t.abs() > 2 * s
        sign = float(((torch.sign(a[clear]) == torch.sign(t[clear])).double().mean())) if clear.any() else float("nan")
        return r, sign, float(t.std(correction=0)) if t.numel() else float("nan"), \
            float(s.pow(2).mean().sqrt()) if s.numel() else float("nan")

    r, sign, spread, err = summary(assigned, truth, se)
    per = {}
    for step in sorted(set(steps.tolist())):
        m = steps == step
        rs, _, sp, er = summary(assigned[m], truth[m], se[m])
        per[int(step)] = {"transitions": int(m.sum()), "pearson": rs, "truth_std": sp, "truth_se": er}
    return Agreement(int(truth.numel()), r, spearman(assigned, truth), sign,
                     r * r if math.isfinite(r) else float("nan"), spread, err, per, bootstrap_ci(assigned, truth))


def bootstrap_ci(a: torch.Tensor, b: torch.Tensor, draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The 2.5% and 97.5% quantiles of the Pearson correlation over transitions drawn with replacement: how far
    the correlation of this many transitions can move (its Monte Carlo noise included)."""
    n = a.numel()
    if n < 3:
        return float("nan"), float("nan")
    idx = torch.randint(n, (draws, n), generator=torch.Generator().manual_seed(seed))
    x, y = a.double()[idx], b.double()[idx]  # (draws, n)
    x, y = x - x.mean(1, keepdim=True), y - y.mean(1, keepdim=True)
    den = (x.pow(2).sum(1) * y.pow(2).sum(1)).sqrt()
    r = (x * y).sum(1) / den
    r = r[torch.isfinite(r)]
    if not r.numel():
        return float("nan"), float("nan")
    lo, hi = torch.quantile(r, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return lo, hi


# ----------------------------------------------------------------------------------------- on a model
@dataclass
class LabelCredit:
    """One label's measurement: its agreement with the truth and what it cost."""

    label: str
    algorithm: str
    agreement: Agreement | None
    rollout_evaluations: int  # transformer evaluations of the rollout (node velocities, CFG counted once)
    trained: int  # trained transitions
    evaluations_per_transition: float  # (rollout + one update forward per trained transition) / trained
    truth_evaluations: int  # what the Monte Carlo truth cost
    seconds: float
    skipped: str = ""  # why the label was not measured (not a transition method, ...)
    assigned_by_step: dict = field(default_factory=dict)  # step -> assigned advantages along the trajectories
    transitions: list = field(default_factory=list)  # per trained transition: step, prompt, assigned, truth, SE

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "agreement"}
        out.update(self.agreement.__dict__ if self.agreement is not None else {})
        return out


class ModelStepper:
    """One continuation step on the model: velocities for the rows' prompts (CFG as the rollout), then the ODE step
    or the rollout's SDE kernel with the given noise (the same low-pass options)."""

    def __init__(self, adapter, cond, negative, guidance_scale: float, max_batch: int, kernel: str,
                 sigma_at_one: float, kernel_options: dict):
        self.adapter, self.cond, self.negative = adapter, cond, negative
        self.guidance_scale, self.max_batch, self.kernel = guidance_scale, max_batch, kernel
        self.sigma_at_one, self.kernel_options = sigma_at_one, kernel_options

    @torch.no_grad()
    def __call__(self, x, rows, sigma_from, sigma_to, sde, level, noise):
        from .engine import velocity_batched
        from .samplers.kernels import step as kernel_step

        device = self.adapter.device
        xd = x.to(device)
        v, _ = velocity_batched(self.adapter, xd, sigma_from.to(device), self.cond, rows.to(device), self.max_batch,
                                self.guidance_scale, self.negative)
        out = torch.empty_like(xd)  # (N, *latent)
        ode = ~sde
        if ode.any():
            out[ode] = kernel_step("ode", xd[ode], v[ode], sigma_from[ode].to(device), sigma_to[ode].to(device),
                                   noise_level=0.0).sample
        for lv in torch.unique(level[sde]).tolist():
            m = sde & (level == lv)
            out[m] = kernel_step(self.kernel, xd[m], v[m], sigma_from[m].to(device), sigma_to[m].to(device),
                                 noise_level=lv, sigma_at_one=self.sigma_at_one, noise=noise[m].to(device),
                                 **self.kernel_options).sample
        return out.cpu()


def measure_label(label: str, cfg, prompt_rows: list[int], draws: int, seed: int, antithetic: bool = True,
                  progress: bool = True, adapters: dict | None = None) -> LabelCredit:
    """Roll out ``cfg``'s plan for the chosen prompts (the first draw of ``seed``), let its algorithm assign
    advantages and choose its trained transitions, and measure them against the Monte Carlo truth."""
    import json
    import random
    import time

    from tqdm.auto import tqdm

    from .algorithms import TransitionAlgorithm, make_algorithm
    from .engine import rollout
    from .models import load_adapter
    from .prompts import PromptSource
    from .rewards import build_reward_set
    from .sampling import Sampler, kernel_options, resolve_device

    t0 = time.perf_counter()
    algo = make_algorithm(cfg)
    if not isinstance(algo, TransitionAlgorithm):
        return LabelCredit(label, cfg.algorithm.name, None, 0, 0, float("nan"), 0, 0.0,
                           skipped="not a transition method: its loss has no per-transition advantage")
    source = PromptSource.from_config(cfg.data, cfg.train.seed, cfg.model)
    prompts = [source.prompts[i % len(source.prompts)] for i in prompt_rows]
    metadata = [source.metadata[i % len(source.prompts)] for i in prompt_rows]
    rewards = build_reward_set(cfg.rewards)
    algo.check_inputs(rewards, source)
    key = json.dumps(cfg.model.model_dump(mode="json"), sort_keys=True) + cfg.device
    adapters = {} if adapters is None else adapters
    if key not in adapters:
        adapters[key] = load_adapter(cfg.model, resolve_device(cfg.device))
    adapter = adapters[key]
    adapter.transformer.eval()
    sampler = Sampler(cfg, adapter, num_steps=cfg.sampler.num_steps)
    sigmas, negative = sampler.sigmas, sampler.negative
    latent_shape = adapter.latent_shape(cfg.model.resolution)
    kopts = kernel_options(cfg)
    from .algorithms import AlgorithmContext

    try:  # what a method keeps of the model; there is no policy here (a method that needs one keeps nothing)
        algo.attach(None, AlgorithmContext(source, rewards, sampler))
    except AttributeError:
        pass
    algo.remember_prompts(prompts, metadata)
    gen = torch.Generator().manual_seed(seed)
    plan = algo.plan(0, random.Random(seed), sigmas)
    if plan.guidance is not None:
        return LabelCredit(label, cfg.algorithm.name, None, 0, 0, float("nan"), 0, time.perf_counter() - t0,
                           skipped="its rollout is guided by a reward gradient, which the continuations do not "
                                   "reproduce")
    cond = adapter.encode_prompts(prompts)
    s = cfg.sampler
    tree = rollout(adapter, cond, plan, sigmas, latent_shape, max_batch=s.max_batch, guidance_scale=s.guidance_scale,
                   negative=negative, kernel=s.kernel, noise_level=s.noise_level, generator=gen,
                   kernel_options=kopts, log_prob_reduce=cfg.train.log_prob_reduce).to("cpu")

    def score(latents: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        out = []
        for a in range(0, latents.shape[0], 256):
            images = adapter.decode(latents[a:a + 256].to(adapter.device))
            r = rows[a:a + 256].tolist()
            out.append(rewards(images, [prompts[g] for g in r], [metadata[g] for g in r]).total)
        return torch.cat(out)

    scores = rewards(adapter.decode(tree.leaves.to(adapter.device)), [prompts[g] for g in tree.leaf_group.tolist()],
                     [metadata[g] for g in tree.leaf_group.tolist()])
    node_adv, keep, _ = algo.reward_advantages(tree, scores, rewards.weights, 0, prompts)
    masks = [m & k for m, k in zip(algo.select_edges(tree, gen), keep)]
    weights = algo.loss_weights(tree, masks) or {}
    transitions = []
    for d in range(1, tree.num_rounds + 1):
        for c in torch.nonzero(masks[d] & tree.sde[d]).flatten().tolist():
            p = int(tree.parent[d][c])
            step = int(tree.index[d - 1][p])
            transitions.append(Transition(d, c, p, step, int(tree.group[d][c]),
                                          float(node_adv[d][c]) * float(weights.get(step, 1.0))))
    if not transitions:
        return LabelCredit(label, cfg.algorithm.name, None, tree.nfe, 0, float("nan"), 0,
                           time.perf_counter() - t0, skipped="its first iteration trains no stochastic transition")
    noise = noise_table(len(prompts), draws, tree.num_steps, latent_shape, seed + 1, antithetic)
    stepper = ModelStepper(adapter, cond, negative, s.guidance_scale, s.max_batch, s.kernel,
                           float(sigmas[1]), kopts)
    with tqdm(desc=f"credit {label}", unit="eval", disable=not progress) as bar:
        truth = true_advantages(tree, transitions, stepper, score, noise, s.noise_level, bar.update)
    assigned = torch.tensor([e.assigned for e in transitions], dtype=torch.float64)
    steps = torch.tensor([e.step for e in transitions])
    by_step: dict[int, list[float]] = {}
    for e in transitions:
        by_step.setdefault(e.step, []).append(e.assigned)
    kl_forward = 1 if cfg.train.kl_beta > 0 else 0  # the reference's forward on each trained transition
    per = (tree.nfe + len(transitions) * (1 + kl_forward)) / len(transitions)
    raw = [{"step": e.step, "prompt": e.prompt, "assigned": e.assigned, "truth": float(t), "truth_se": float(se)}
           for e, t, se in zip(transitions, truth.value, truth.se)]
    return LabelCredit(label, cfg.algorithm.name, agreement(assigned, truth.value, truth.se, steps), tree.nfe,
                       len(transitions), per, truth.evaluations, time.perf_counter() - t0,
                       assigned_by_step=by_step, transitions=raw)


def format_credit_table(results: list[LabelCredit]) -> str:
    """The credit table as Markdown (what the terminal shows too)."""
    head = ("| label | algorithm | trained transitions | Pearson | Pearson 95% interval | Spearman | sign agreement | "
            "variance explained | truth std | truth SE | evaluations per transition |")
    lines = [head, "|" + "---|" * 11]
    for r in results:
        if r.agreement is None:
            lines.append(f"| {r.label} | {r.algorithm} | {r.trained} | - | - | - | - | - | - | - | ({r.skipped}) |")
            continue
        a = r.agreement
        lo, hi = a.pearson_ci
        lines.append(f"| {r.label} | {r.algorithm} | {r.trained} | {a.pearson:+.3f} | {lo:+.2f} .. {hi:+.2f} | "
                     f"{a.spearman:+.3f} | "
                     f"{a.sign:.3f} | {a.explained:.3f} | {a.truth_std:.4f} | {a.truth_se:.4f} | "
                     f"{r.evaluations_per_transition:.2f} |")
    return "\n".join(lines)


def plot_credit(results: list[LabelCredit], path) -> None:
    """Pearson correlation with the truth per denoising step, one line per label."""
    from .report.files import save_figure

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        if r.agreement is None:
            continue
        steps = sorted(r.agreement.per_step)
        ys = [r.agreement.per_step[s]["pearson"] for s in steps]
        ax.plot(steps, ys, marker="o", label=r.label)
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xlabel("denoising step of the action")
    ax.set_ylabel("Pearson correlation with the true advantage")
    ax.set_title("step-level credit against Monte Carlo truth")
    ax.legend(fontsize=7, ncol=2)
    save_figure(fig, path)
