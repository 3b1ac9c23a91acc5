"""AdaGRPO (arXiv 2606.06828): TempFlow's side-branch tree at every other step of the first half, plus a
capability curriculum: each iteration ``candidates`` prompts get one ODE anchor each, an EMA of the anchor
scores tracks the policy's capability, and the prompts nearest it are trained; the advantage adds a score
against that capability to the within-group z-score. Formulas: flowrl/trackers.py."""

from __future__ import annotations

import time

import torch

from ..config import iteration_seed, opt
from ..errors import ConfigError
from ..trackers import CapabilityEMA, adagrpo_advantages
from .side_branch import SideBranchAlgorithm, SideOptions


class AdaGRPOOptions(SideOptions):
    candidates: int = opt(10, "candidate prompts scored with one ODE anchor each per iteration", lo=1)
    ema_alpha: float = opt(0.8, "EMA of the anchor scores' mean and variance", lo=0.0, hi=1.0)


class AdaGRPO(SideBranchAlgorithm):
    Options = AdaGRPOOptions

    @classmethod
    def check(cls, cfg) -> None:
        if cfg.advantage.combine == "per_reward":
            raise ConfigError("advantage.combine=per_reward: ada_grpo's capability follows the summed reward; "
                              "use advantage.combine=sum")

    def __init__(self, cfg):
        super().__init__(cfg)
        self.capability = CapabilityEMA(self.opts.ema_alpha)

    @staticmethod
    def default_steps(t: int) -> list[int]:
        return list(range(0, max(t // 2, 1), 2))  # {0, 2, 4, 6} of 16

    def choose_prompts(self, ctx, it, gen, row):
        """Score one ODE anchor per candidate, update the capability EMA, keep the candidates nearest it."""
        cand, meta = ctx.prompts.batch(it, self.opts.candidates)
        t0 = time.perf_counter()
        anchors = ctx.sample(cand, [iteration_seed(self.cfg.train.seed, it)])
        scores = ctx.rewards(anchors, cand, meta).total
        self.capability.update(scores[torch.isfinite(scores)])
        keep = self.capability.closest(torch.nan_to_num(scores, nan=float("inf")), self.cfg.train.prompts_per_iter)
        row.update({"curriculum/anchor_score_mean": float(scores.nanmean()), "curriculum/capability": self.capability.mean,
                    "curriculum/seconds": time.perf_counter() - t0,
                    # the candidates' ODE anchors are rollout work too (counted in nfe_rollout_cum)
                    "curriculum/nfe": len(cand) * self.cfg.sampler.num_steps, "curriculum/images": len(cand)})
        return [cand[i] for i in keep], [meta[i] for i in keep], None

    def leaf_advantages(self, tree, rewards, baselines):
        _, stats = super().leaf_advantages(tree, rewards, baselines)
        adv = self.cfg.advantage
        c = self.capability
        out = adagrpo_advantages(torch.where(torch.isfinite(rewards), rewards, torch.nan), self.leaf_groups(tree),
                                 c.mean, c.var ** 0.5, adv.clip, adv.eps)
        return torch.nan_to_num(out, nan=0.0), stats

    def state_dict(self) -> dict:
        return {**super().state_dict(), "capability": self.capability.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if "capability" in state:
            self.capability.load_state_dict(state["capability"])
