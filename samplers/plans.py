"""Rollout plans: what happens at each denoising index, as data.

A plan is a list of :class:`StepSpec` (one per denoising index i, mapping sigma_i -> sigma_{i+1}) plus the
number of independent initial noises per prompt. Flat GRPO with independent noise is ``roots_per_prompt=G``
and branch 1 everywhere; DanceGRPO's shared noise is ``roots_per_prompt=1`` with branch G at the first SDE
step; trees (BranchGRPO) put branch factors K at several split steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepSpec:
    sde: bool = True  # SDE (stochastic, has a log-prob) or ODE (deterministic Euler)
    branch: int = 1  # children per node at this step (must be 1 on ODE steps)
    trained: bool = False  # whether edges of this step are candidates for the policy update
    noise_level: float | None = None  # None: the sampler's default


@dataclass
class RolloutPlan:
    steps: list[StepSpec]
    roots_per_prompt: int = 1
    notes: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.roots_per_prompt < 1:
            raise ValueError("roots_per_prompt must be >= 1")
        for i, s in enumerate(self.steps):
            if s.branch < 1:
                raise ValueError(f"step {i}: branch must be >= 1")
            if not s.sde and s.branch > 1:
                raise ValueError(f"step {i}: an ODE step cannot branch (its children would be identical)")
            if s.trained and not s.sde:
                raise ValueError(f"step {i}: only SDE steps have a log-prob and can be trained")

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    def nodes_per_depth(self) -> list[int]:
        """Nodes per prompt at depth 0..T (depth d holds latents at sigma_d)."""
        counts = [self.roots_per_prompt]
        for s in self.steps:
            counts.append(counts[-1] * s.branch)
        return counts

    @property
    def leaves_per_prompt(self) -> int:
        return self.nodes_per_depth()[-1]

    def nfe_per_prompt(self) -> int:
        """Model evaluations per prompt in the rollout: one per parent node (a parent's velocity serves all
        of its children)."""
        return sum(self.nodes_per_depth()[:-1])

    def edges_per_prompt(self) -> int:
        return sum(self.nodes_per_depth()[1:])

    def trained_edges_per_prompt(self) -> int:
        counts = self.nodes_per_depth()
        return sum(counts[i + 1] for i, s in enumerate(self.steps) if s.trained)

    def accounting(self) -> dict:
        leaves = self.leaves_per_prompt
        return {
            "leaves_per_prompt": leaves,
            "nfe_rollout_per_leaf": self.nfe_per_prompt() / leaves,
            "edges_per_leaf": self.edges_per_prompt() / leaves,
            "trained_edges_per_leaf": self.trained_edges_per_prompt() / leaves,
        }

    def describe(self) -> str:
        marks = "".join(("S" if s.sde else "o") + (str(s.branch) if s.branch > 1 else "") + ("*" if s.trained else "")
                        for s in self.steps)
        return f"roots={self.roots_per_prompt} steps=[{marks}] (S=SDE, o=ODE, digit=branch, *=trained)"
