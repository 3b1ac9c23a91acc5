"""GARDO (arXiv 2512.24138): Flow-GRPO's rollouts and PPO update with three changes against reward hacking.

1. **Diversity-aware advantages** on the main (first) reward alone: within a prompt's group, ``d_i`` is the
   sample's cosine distance to its nearest other sample, and ``A_i = (r_i - mean r) d_i / mean d`` for samples at or
   above the group mean, ``r_i - mean r`` below it; no division by the std; clipped at ``advantage.clip``.
   The features are the decoded images' embeddings by ``diversity_model`` (a transformers vision backbone; the
   official code uses DINOv3 ViT-L/16), computed beside the rewards; without one, the clean latents (self-contained,
   no extra model, and what the tiny presets use).
2. **A gated KL.** Over the batch, each sample is ranked (1 = best) by the main reward and by the auxiliary rewards
   (every further reward of the config; they only gate, they do not enter the advantage); with
   ``u = rank_main - mean(rank_aux)``, the KL to the reference applies only to samples whose u is non-negative and
   above the ``1 - beta_t`` quantile of the non-negative u's, averaged over them. ``beta_t`` starts at
   ``gate_fraction``; each iteration, before the gate, it grows x1.1 when the mean of the non-negative u's exceeds
   the largest of the last 20 such means and shrinks x0.9 when below the smallest, within [``gate_min``,
   ``gate_max``]. The sign of u and the order are the official code's.
3. **An adaptive reference**: the reference becomes a copy of the current weights every ``reset_every``
   iterations, or as soon as one optimizer step's mean KL exceeds ``kl_threshold`` (as the published code checks it
   after every step; the reset itself follows the iteration).

Defaults from the official code (SD3.5-M: beta 0.04 for OCR, 0.07 GenEval; clip 1e-4; reset 15; threshold 3e-4).
A resumed run starts its reference from the resumed weights."""

from __future__ import annotations

import torch

from ..config import opt
from ..errors import ConfigError
from .transition import TransitionAlgorithm, TransitionOptions


class GARDOOptions(TransitionOptions):
    diversity: bool = opt(True, "scale the above-mean advantages by the sample's distance to its nearest group "
                          "member (relative to the group's mean distance)")
    diversity_model: str = opt("", "a transformers vision backbone (hub id or local folder, e.g. "
                               "facebook/dinov3-vitl16-pretrain-lvd1689m) whose pooled image embeddings measure the "
                               "distances; empty: the clean latents")
    gate_fraction: float = opt(0.1, "beta_t at the start: the fraction of samples (of those the auxiliaries rate "
                               "at least as high as the main reward) that get the KL", lo=0.0, lo_open=True, hi=1.0)
    gate_min: float = opt(0.02, "lower bound of beta_t", lo=0.0, hi=1.0)
    gate_max: float = opt(0.2, "upper bound of beta_t", lo=0.0, hi=1.0)
    reset_every: int = opt(15, "iterations after which the reference becomes the current weights", lo=1)
    kl_threshold: float = opt(3e-4, "an optimizer step whose mean KL exceeds this resets the reference", lo=0.0,
                              lo_open=True)
    kl_average: str = opt("micro_batch", "how the gated KL is averaged, in the gradient and in the reset's "
                          "statistic: micro_batch (the published code: the mean over each micro-batch's gated "
                          "samples, a micro-batch without one counting 0, then the mean over micro-batches) or "
                          "gated (over every gated sample of the minibatch at once: about 1/(1 - (1 - s)^m) times "
                          "larger at gated share s and micro-batch size m, 4x at 3% and 9)",
                          choices=["micro_batch", "gated"])


def diversity_advantages(rewards: torch.Tensor, features: torch.Tensor, groups: torch.Tensor,
                         diversity: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """rewards (L,), features (L, D), groups (L,) -> (advantages (L,), nearest-neighbour distances (L,)). NaN
    rewards get advantage 0 and are left out of their group's statistics."""
    f = torch.nn.functional.normalize(features.flatten(1).double(), dim=1)
    adv, dist = torch.zeros(len(rewards), dtype=torch.float64), torch.zeros(len(rewards), dtype=torch.float64)
    for g in groups.unique().tolist():
        idx = ((groups == g) & torch.isfinite(rewards)).nonzero().flatten()
        if len(idx) < 2:
            continue
        r = rewards[idx].double()
        cos_dist = 1 - f[idx] @ f[idx].T
        d = cos_dist.fill_diagonal_(float("inf")).min(dim=1).values  # each sample's nearest other sample
        dist[idx] = d
        a = r - r.mean()
        if diversity and float(d.mean()) > 0:
            a = torch.where(r >= r.mean(), a * d / d.mean(), a)
        adv[idx] = a
    return adv.float(), dist.float()


def descending_ranks(values: torch.Tensor) -> torch.Tensor:
    """(N,) -> ranks 1..N, 1 for the largest (ties in index order)."""
    order = torch.argsort(values, descending=True, stable=True)
    ranks = torch.empty(len(values), dtype=torch.float64)
    ranks[order] = torch.arange(1, len(values) + 1, dtype=torch.float64)
    return ranks


def uncertainty(main: torch.Tensor, auxiliaries: list[torch.Tensor]) -> torch.Tensor:
    """u (N,) = rank by the main reward - mean rank by the auxiliaries (1 = best): positive where the auxiliaries
    rate the sample higher than the main reward does."""
    return descending_ranks(main) - torch.stack([descending_ranks(a) for a in auxiliaries]).mean(0)


def kl_gate(main: torch.Tensor, auxiliaries: list[torch.Tensor], fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate (N,) bool, u (N,)): the gate on the samples whose u (:func:`uncertainty`) is non-negative and above
    the (1 - fraction) quantile of the non-negative u's."""
    u = uncertainty(main, auxiliaries)
    nonneg = u[u >= 0]
    if not len(nonneg):
        return torch.zeros(len(u), dtype=torch.bool), u
    threshold = torch.quantile(nonneg, 1 - fraction)
    return (u >= 0) & (u > threshold), u


class GARDO(TransitionAlgorithm):
    # the published update (train_sd3_grpo_gardo.py, compute_log_prob) keeps CFG's unconditional half in the graph
    cfg_unconditional_grad = True
    Options = GARDOOptions
    fusable_loss_rows = False  # loss_rows gates the KL per edge

    def __init__(self, cfg):
        super().__init__(cfg)
        self.beta_t, self.history, self.since_reset = self.opts.gate_fraction, [], 0
        self.gate_nodes, self.gate_share, self.policy = None, 0.0, None

    @classmethod
    def check(cls, cfg) -> None:
        if cfg.train.kl_beta <= 0:
            raise ConfigError("train.kl_beta: gardo gates the KL to its reference; set train.kl_beta > 0 (the "
                              "code: 0.04 OCR, 0.07 GenEval)")
        if len(cfg.rewards) < 2:
            raise ConfigError("rewards: gardo's KL gate compares the main (first) reward with auxiliary rewards; "
                              "add at least one more reward (the code: aesthetic and imagereward)")
        if cfg.train.kl_reference != "initial":
            raise ConfigError("train.kl_reference: gardo moves its own reference; leave train.kl_reference=initial")
        if cfg.algorithm.gate_min > cfg.algorithm.gate_max:
            raise ConfigError("algorithm.gate_min: must not exceed algorithm.gate_max")

    def check_inputs(self, rewards, prompts=None) -> None:
        """With ``diversity_model``: load it now (a missing model fails before any work) and have the reward set
        embed every rollout image beside its scores."""
        if self.opts.diversity and self.opts.diversity_model:
            from ..rewards.embedding import image_embedder

            rewards.embed_images_with(image_embedder(self.opts.diversity_model))

    def reference_copies(self) -> int:
        return 1  # the moving reference

    def attach(self, policy, ctx) -> None:
        self.policy = policy
        policy.reset_anchor()

    def reward_advantages(self, tree, scores, weights, it, prompts=None):
        """Advantages from the main reward alone (diversity-scaled), and the per-sample KL gate from all rewards."""
        names = list(scores.components)
        main = torch.where(scores.invalid, torch.nan, scores.components[names[0]])
        features = scores.features if scores.features is not None else tree.leaves.cpu()  # (L, D) / (L, C, H, W)
        adv, dist = diversity_advantages(main, features, tree.leaf_group, self.opts.diversity)
        adv = adv.clamp(-self.cfg.advantage.clip, self.cfg.advantage.clip)
        fill = torch.nan_to_num(main, nan=float("-inf"))
        aux = [torch.nan_to_num(scores.components[n], nan=float("-inf")) for n in names[1:]]
        self.update_gate_fraction(uncertainty(fill, aux))  # beta_t first, then the gate with it (the code's order)
        gate, u = kl_gate(fill, aux, self.beta_t)
        self.gate_nodes = tree.node_values_from_leaves(gate.float())
        self.gate_share = float(gate.float().mean())
        keep = [torch.ones(x.shape[0], dtype=torch.bool) for x in tree.latents]
        stats = {"gardo_gated": float(gate.float().mean()), "gardo_beta_t": self.beta_t,
                 "gardo_nearest_distance": float(dist.mean())}
        return tree.node_values_from_leaves(adv), keep, stats

    def update_gate_fraction(self, u: torch.Tensor) -> None:
        """beta_t from the mean of the non-negative u's: x1.1 above the largest of the last 20, x0.9 below the
        smallest, ``gate_fraction`` on the first iteration; within [gate_min, gate_max]."""
        level = float(u[u >= 0].double().mean())
        if not self.history:
            self.beta_t = self.opts.gate_fraction
        elif level > max(self.history):
            self.beta_t *= 1.1
        elif level < min(self.history):
            self.beta_t *= 0.9
        self.beta_t = min(max(self.beta_t, self.opts.gate_min), self.opts.gate_max)
        self.history = (self.history + [level])[-20:]

    def loss_rows(self, items, log_prob, old_log_prob, adv, kl, step):
        """The KL of the gated samples only. The objective averages rows over the minibatch, so a row's KL is scaled
        to give, per ``kl_average``: the mean over this micro-batch's gated rows (its m rows x kl / k gated; none
        gated: 0), which the minibatch's mean turns into the mean over micro-batches of equal size, as the
        published code averages them; or the mean over every gated row (kl / the gated share)."""
        gate = torch.tensor([float(self.gate_nodes[u.depth + 1][c]) for it in items for u in it for c in u.children],
                            device=kl.device)
        if self.opts.kl_average == "micro_batch":
            gated = float(gate.sum())
            kl = kl * gate * (gate.numel() / gated) if gated > 0 else kl * 0
        else:
            kl = kl * gate / self.gate_share if self.gate_share > 0 else kl * 0
        return log_prob - old_log_prob, adv, kl, step

    def observe_update(self, stats: dict) -> None:
        super().observe_update(stats)
        self.since_reset += 1
        # as the published code: any optimizer step whose mean KL passed the threshold resets the reference
        reset = self.since_reset > self.opts.reset_every or stats.get("kl_loss_step_max", 0.0) > self.opts.kl_threshold
        stats["gardo_reference_reset"] = float(reset)
        if reset and self.policy is not None:
            self.policy.reset_anchor()
            self.since_reset = 0

    def state_dict(self) -> dict:
        return {**super().state_dict(), "beta_t": self.beta_t, "history": self.history, "since_reset": self.since_reset}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.beta_t = state.get("beta_t", self.beta_t)
        self.history, self.since_reset = state.get("history", []), state.get("since_reset", 0)
