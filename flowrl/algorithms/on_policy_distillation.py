"""On-policy distillation: the student (the trained policy) rolls out with its own SDE, and at every trained
transition it is pulled toward the teacher's transition from the same state, the Gaussian KL between the two
transitions over the student's std,

    L = train.kl_beta mean_k mean((mu_theta(x_k) - mu_T(x_k))^2) / (2 s_k^2)   (+ reward_weight x PPO(A)),

with the teacher in the KL reference's place: a flowrl checkpoint (a run folder or a checkpoint folder) of the
same model, read once at the start (``algorithm.teacher``). With ``reward_weight`` 0 (the default) no reward enters
the loss: the reward is only logged, and the loss is pure distillation (verl-omni's ``distill_kl`` and UniRL's
DiffusionOPD); with 1 it is Flow-GRPO's update plus the distillation term (verl-omni's recipe with a distillation
coefficient). ``teachers`` instead gives one teacher per value of a prompt metadata field (``domain_key``): each
prompt's samples are pulled toward their domain's teacher (UniRL's routing of frozen task teachers; Flow-OPD's
single-reward teachers). ``train.kl_std`` chooses the std (the transition's, or Flow-GRPO's without sqrt(|dt|)); the first
update's ratio is still logged and is 1."""

from __future__ import annotations

import torch

from ..config import opt
from ..errors import ConfigError
from ..objectives import EdgeTerms, TrainingParts, TransitionObjective, velocities
from .transition import TransitionAlgorithm, TransitionOptions


class OnPolicyDistillationOptions(TransitionOptions):
    teacher: str = opt("", "the teacher: a flowrl run folder or checkpoint folder of the same model and LoRA layout "
                       "(its weights become the KL reference)")
    teachers: dict[str, str] = opt({}, "one teacher per domain instead: {domain: run or checkpoint folder}; a "
                                   "prompt's domain is its metadata field domain_key")
    domain_key: str = opt("domain", "with teachers: the prompt metadata field naming each prompt's domain")
    reward_weight: float = opt(0.0, "weight of the reward's PPO term beside the distillation (0 = pure "
                               "distillation; the reward is still logged)", lo=0.0)


class OnPolicyDistillation(TransitionAlgorithm):
    Options = OnPolicyDistillationOptions

    @classmethod
    def check(cls, cfg) -> None:
        if cfg.algorithm.teacher and cfg.algorithm.teachers:
            raise ConfigError("algorithm.teachers: give algorithm.teacher or algorithm.teachers, not both")
        if not cfg.algorithm.teacher and not cfg.algorithm.teachers:
            raise ConfigError("algorithm.teacher: on_policy_distillation needs the teacher's run or checkpoint "
                              "folder; set algorithm.teacher=PATH (or algorithm.teachers={domain: PATH, ...})")
        if cfg.train.kl_beta <= 0:
            raise ConfigError("train.kl_beta: on_policy_distillation's loss is train.kl_beta x the KL to the "
                              "teacher; set train.kl_beta > 0 (1.0 is the published coefficient)")
        if cfg.train.kl_reference != "initial":
            raise ConfigError("train.kl_reference: on_policy_distillation's reference is the teacher; leave "
                              "train.kl_reference=initial")

    def reference_checkpoints(self) -> dict[str | None, str]:
        """The teacher, or the teachers by domain: the trainer reads them into the KL reference's place."""
        return dict(self.opts.teachers) or {None: self.opts.teacher}

    def reference_copies(self) -> int:
        return max(1, len(self.opts.teachers))

    def check_inputs(self, rewards, prompts=None) -> None:
        """With ``teachers``: every training prompt's domain has a teacher."""
        if not self.opts.teachers or prompts is None:
            return
        key = self.opts.domain_key
        for text, meta in zip(prompts.prompts, prompts.metadata):
            domain = (meta or {}).get(key)
            if domain is None:
                raise ConfigError(f"algorithm.teachers: prompt {text[:60]!r} has no metadata field {key!r} "
                                  f"(algorithm.domain_key); give every prompt its domain")
            if str(domain) not in self.opts.teachers:
                raise ConfigError(f"algorithm.teachers: prompt {text[:60]!r} has domain {str(domain)!r}, which has no "
                                  f"teacher; add it to algorithm.teachers")

    def teacher_of_rows(self, rows: list[int]) -> list[str] | None:
        """The teacher name of each of the iteration's prompt rows, or None with a single teacher."""
        if not self.opts.teachers:
            return None
        return [str(self.metadata[r][self.opts.domain_key]) for r in rows]

    def make_objective(self, parts):
        """The transitions' objective with the policy term scaled by ``reward_weight``."""

        return DistillationObjective(self, parts)


class DistillationObjective(TransitionObjective):
    """On-policy distillation: the transitions' objective, whose KL term's reference is the teacher, with the PPO
    term scaled by ``algorithm.reward_weight`` (0: the rows are the KL alone)."""

    def __init__(self, algorithm, parts: TrainingParts):
        super().__init__(algorithm, parts)
        self.fused = None  # the policy term is scaled: the eager path

    def policy_rows(self, log_ratio: torch.Tensor, adv: torch.Tensor, edges: EdgeTerms) -> tuple[torch.Tensor, torch.Tensor]:
        loss, ratio = super().policy_rows(log_ratio, adv, edges)
        return self.algorithm.opts.reward_weight * loss, ratio

    def velocities(self, x: torch.Tensor, sigma: torch.Tensor, rows: torch.Tensor, with_reference: bool):
        """With one teacher per domain, each state's reference velocity is its prompt's teacher's."""
        names = self.algorithm.teacher_of_rows(rows.tolist())  # (N,) teacher names, or None for one teacher
        if names is None:
            return super().velocities(x, sigma, rows, with_reference)
        # sharded: every teacher's pass in every micro-batch (the processes' collectives must match)
        order = sorted(self.algorithm.opts.teachers) if self.parts.policy.sharded else list(dict.fromkeys(names))
        references = [(n, torch.tensor([i for i, m in enumerate(names) if m == n], dtype=torch.long,
                                    device=x.device)) for n in order]
        return velocities(self.parts, x, sigma, self.batch.cond.index(rows), with_reference, references)
