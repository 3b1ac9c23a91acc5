"""Rollout plans: what happens at each denoising index, as data.

A plan is a list of :class:`StepSpec` (one per denoising index i, mapping sigma_i -> sigma_{i+1}) plus the
number of independent initial noises (roots) per prompt. Nodes come in two roles:

- **main** nodes follow the step specs: at index i each main node has ``branch`` main children (SDE or ODE,
  to index i + 1) and ``side`` side children;
- **side** children take one SDE step from sigma_i straight to sigma_{i + side_merge} (E-GRPO's merged step;
  1 = an ordinary step) and are then *completed*: one ODE step per index down to sigma_T, never branching.

Flat GRPO with independent noise is ``roots_per_prompt=G`` and branch 1 everywhere; DanceGRPO's shared noise
is one root with branch G at the first SDE step; BranchGRPO puts branch K at its split steps; TempFlow-GRPO
and E-GRPO run an ODE main (anchor) line with ``side=K`` at the active steps and ``branch=0`` after the last
one (the anchor itself is never scored, so it stops there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

SIBLING_NOISE = ("independent", "correlated", "scaled", "antithetic")


@dataclass
class StepSpec:
    sde: bool = True  # main children: SDE (stochastic, has a log-prob) or ODE (deterministic Euler)
    branch: int = 1  # main children per main node (> 1 only on SDE steps; 0 ends the main line here)
    trained: bool = False  # whether main edges of this step are candidates for the policy update
    noise_level: float | None = None  # None: the sampler's default
    side: int = 0  # side children per main node: SDE jumps to index i + side_merge, then ODE to the end
    side_merge: int = 1
    # G2RPO's multi-granularity completion: each side child is finished once per stride g (ODE steps of g
    # grid indices, the last one clipped at sigma_T); (1,) is the ordinary completion
    side_granularities: tuple[int, ...] = (1,)
    # how the `branch` siblings of one parent draw their noise (BranchGRPO):
    #   independent: iid N(0, I) each;
    #   correlated:  xi_b = (xi_0 + s * eta_b) / sqrt(1 + s^2), xi_0 shared by the siblings (marginal N(0, I));
    #   scaled:      s * eps_b, log-prob still under the unscaled std (the released BranchGRPO code, s = 4)
    #   antithetic:  eps_{b + branch/2} = -eps_b (mirrored pairs; each N(0, I); an even branch)
    sibling_noise: str = "independent"
    sibling_strength: float = 4.0
    # the plan's guidance shifts this step's main-line SDE sample (reward-gradient guidance, Euphonium); the
    # log-prob stays that of the unguided transition
    guided: bool = False


def _shape(s: StepSpec) -> tuple:
    """What a per-prompt variant of a step must keep: everything but ``sde`` and ``trained``."""
    return (s.branch, s.noise_level, s.side, s.side_merge, tuple(s.side_granularities), s.sibling_noise,
            s.sibling_strength)


@dataclass
class RolloutPlan:
    steps: list[StepSpec]
    roots_per_prompt: int = 1
    notes: dict = field(default_factory=dict)
    # guided steps call guidance(x, v, sigma, sigma_next, rows) -> (shift of the sample (N, *latent), process
    # reward (N,)), with x, v (N, *latent) the parents and their velocities and rows their prompt rows
    guidance: Callable | None = None
    # per-prompt step specs (a step drawn per prompt, Flash-GRPO's): prompt row g follows
    # prompt_steps[g % len(prompt_steps)] instead of ``steps``. The variants share ``steps``' shape (branch, side
    # branches, noise, guidance at every index), so every prompt's nodes go through the same rounds; they differ only
    # in which steps are SDE and which are trained
    prompt_steps: list[list[StepSpec]] | None = None

    def __post_init__(self):
        if self.roots_per_prompt < 1:
            raise ValueError("roots_per_prompt must be >= 1")
        self._check_steps(self.steps)
        for v, variant in enumerate(self.prompt_steps or []):
            if len(variant) != len(self.steps):
                raise ValueError(f"prompt_steps[{v}]: {len(variant)} steps, the plan has {len(self.steps)}")
            self._check_steps(variant)
            for i, (a, b) in enumerate(zip(variant, self.steps)):
                if _shape(a) != _shape(b) or a.guided or b.guided:
                    raise ValueError(f"prompt_steps[{v}] step {i}: a prompt's steps may differ from the plan's only "
                                     "in sde and trained (and take no guidance)")

    def spec(self, index: int, row: int = 0) -> StepSpec:
        """The step spec at grid ``index`` for prompt row ``row``."""
        if self.prompt_steps:
            return self.prompt_steps[row % len(self.prompt_steps)][index]
        return self.steps[index]

    def _check_steps(self, steps: list[StepSpec]) -> None:
        t = len(steps)
        for i, s in enumerate(steps):
            if s.branch < 0 or s.side < 0:
                raise ValueError(f"step {i}: branch and side must be >= 0")
            if s.branch == 0 and s.side == 0:
                raise ValueError(f"step {i}: branch 0 ends the main line, which needs side branches at that step")
            if not s.sde and s.branch > 1:
                raise ValueError(f"step {i}: an ODE step cannot branch (its children would be identical)")
            if s.trained and not s.sde:
                raise ValueError(f"step {i}: only SDE steps have a log-prob and can be trained")
            if s.side and not 1 <= s.side_merge <= t - i:
                raise ValueError(f"step {i}: side_merge must be in 1..{t - i}")
            if not s.side_granularities or min(s.side_granularities) < 1:
                raise ValueError(f"step {i}: side_granularities must be positive strides")
            if s.sibling_noise not in SIBLING_NOISE:
                raise ValueError(f"step {i}: sibling_noise must be one of {SIBLING_NOISE}")
            if s.sibling_noise == "antithetic" and s.branch % 2:
                raise ValueError(f"step {i}: antithetic sibling noise needs an even branch, not {s.branch}")

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    def counts(self) -> dict:
        """Per-prompt node and edge counts, by simulating the plan on counts instead of latents."""
        t = self.num_steps
        main = self.roots_per_prompt
        nfe = edges = trained = leaves = 0
        for i, s in enumerate(self.steps):
            nfe += main  # every node above sigma_T is evaluated once
            edges += main * s.branch
            trained += main * s.branch * s.trained
            if s.side:
                n, j = main * s.side, i + s.side_merge  # side children land at index j
                edges += n
                trained += n  # side edges are always training candidates
                if j == t:
                    leaves += n
                else:  # the side child is evaluated once, then one ODE chain per granularity
                    chains = [-(-(t - j) // g) for g in s.side_granularities]  # ceil((T - j) / g) steps each
                    nfe += n * (1 + sum(c - 1 for c in chains))
                    edges += n * sum(chains)
                    leaves += n * len(chains)
            main *= s.branch
        return {"leaves": main + leaves, "nfe": nfe, "edges": edges, "trained_edges": trained}

    @property
    def leaves_per_prompt(self) -> int:
        return self.counts()["leaves"]

    def accounting(self) -> dict:
        c = self.counts()
        leaves = c["leaves"]
        return {
            "leaves_per_prompt": leaves,
            "nfe_rollout_per_leaf": c["nfe"] / leaves,
            "edges_per_leaf": c["edges"] / leaves,
            "trained_edges_per_leaf": c["trained_edges"] / leaves,
        }

    def describe(self) -> str:
        def mark(s: StepSpec) -> str:
            m = ("S" if s.sde else "o") if s.branch else "."
            m += str(s.branch) if s.branch > 1 else ""
            m += "*" if s.trained and s.branch else ""
            if s.side:
                m += f"+{s.side}" + (f"~{s.side_merge}" if s.side_merge > 1 else "")
            return m

        return (f"roots={self.roots_per_prompt} steps=[{' '.join(mark(s) for s in self.steps)}] "
                "(S=SDE, o=ODE, .=main line ended, digit=branch, *=trained, +K=K side SDE branches, ~l=merged l steps)")
