"""DiverseGRPO (arXiv 2512.21514): Flow-GRPO with a creativity bonus for samples far from the rest of their group,
and a mean-matching regulariser on the early denoising steps in place of the uniform KL.

Per prompt group of N samples: pairwise distances d_ij between the samples, the affinity
``A_ij = exp(-d_ij^2 / (2 s^2))`` (A_ii = 0), standard normalised spectral clustering (the leading eigenvectors of
``D^-1/2 A D^-1/2``, rows normalised, k-means), and for a sample in a cluster of n_m members the bonus
``E_i = sqrt(N / n_m)`` (1 when the group is one cluster, sqrt(N) for a singleton). The reward the advantages see is
``Q_i + beta E_i`` with Q the quality reward, z-scored within the group as in Flow-GRPO. The regulariser is
``||mu_theta - mu_ref||^2`` (the per-element mean) on the first ``reg_steps`` denoising steps and nothing after them:
the Gaussian KL without its ``1 / (2 std^2)``, which the paper calls a Wasserstein constraint; ``train.kl_beta`` is
its weight.

No code was published. What the paper leaves open is an option here, each with its reading: the distance (DreamSim in
the paper, not shipped: a vision backbone's embeddings when ``algorithm.embedder`` names one, else the final latents,
which are the images for the tiny shapes model), the kernel width s (the median distance from a sample to its
nearest other sample in the group), the number of clusters (by the largest eigengap, at most ``max_clusters``),
K (a third of the steps: the paper finds two thirds of the diversity change there) and the regulariser's weight
(``train.kl_beta``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..config import opt
from ..errors import ConfigError
from ..rewards.embedding import group_diversity
from ..samplers.kernels import flow_grpo_noise_scale
from .flow_grpo import FlowGRPO, FlowGRPOOptions


class DiverseGRPOOptions(FlowGRPOOptions):
    creativity_beta: float = opt(3.0, "beta of the creativity bonus beta sqrt(N / n_m) added to the quality reward "
                                 "(the paper tries 1, 3 and 5; gains saturate between 3 and 5)", lo=0.0)
    max_clusters: int = opt(0, "at most this many clusters per group, chosen by the largest eigengap (0: half "
                            "the group)", lo=0)
    embedder: str = opt("", "a transformers vision backbone (hub id or local folder), or tiny-clip (the shipped "
                        "shapes CLIP), whose embeddings give the distances (the paper: DreamSim, not shipped); "
                        "empty: the final latents")
    reg_steps: int = opt(-1, "K: the first K denoising steps carry the mean-matching regulariser (-1: a third of "
                         "the steps, where the paper finds two thirds of the diversity change)", lo=-1)


def spectral_clusters(distances: torch.Tensor, max_clusters: int, gen: torch.Generator | None = None) -> torch.Tensor:
    """Normalised spectral clustering of one group: (N, N) distances -> (N,) cluster labels 0..m-1.

    The affinity is a Gaussian of the distances whose width is the median distance from a sample to its nearest
    other sample (a local scale: separated clusters stay apart however far apart they are); the number of
    clusters m is the largest eigengap among the leading ``max_clusters`` eigenvalues of ``D^-1/2 A D^-1/2``; k-means
    runs on the rows of the m leading eigenvectors (normalised), started from the farthest points (deterministic).
    """
    n = distances.shape[0]
    d = distances.double()
    nearest = d.clone().fill_diagonal_(float("inf")).min(dim=1).values if n > 1 else d.new_zeros(1)
    width = float(nearest.median())
    if n < 3 or width <= 0:  # identical samples (or too few): one cluster
        return torch.zeros(n, dtype=torch.long)
    affinity = torch.exp(-d ** 2 / (2 * width ** 2)).fill_diagonal_(0.0)
    inv_sqrt = affinity.sum(dim=1).clamp_min(1e-12).rsqrt()
    values, vectors = torch.linalg.eigh(inv_sqrt[:, None] * affinity * inv_sqrt[None, :])  # ascending
    values, vectors = values.flip(0), vectors.flip(1)  # leading first
    most = max(1, min(max_clusters or n // 2, n - 1))
    gaps = values[:most] - values[1:most + 1]
    m = int(gaps.argmax()) + 1
    if m == 1:
        return torch.zeros(n, dtype=torch.long)
    rows = torch.nn.functional.normalize(vectors[:, :m], dim=1)
    centres = [rows[0]]
    for _ in range(1, m):  # farthest-point start: deterministic, and spread over the clusters
        dist = torch.cdist(rows, torch.stack(centres)).min(dim=1).values
        centres.append(rows[int(dist.argmax())])
    centres = torch.stack(centres)
    labels = torch.zeros(n, dtype=torch.long)
    for _ in range(50):
        labels = torch.cdist(rows, centres).argmin(dim=1)
        moved = torch.stack([rows[labels == c].mean(dim=0) if (labels == c).any() else centres[c] for c in range(m)])
        if torch.allclose(moved, centres):
            break
        centres = moved
    return torch.unique(labels, return_inverse=True)[1]  # 0..m-1 without empty clusters


def creativity_bonus(features: torch.Tensor, groups: torch.Tensor, valid: torch.Tensor,
                     max_clusters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """features (L, ...) , groups (L,), valid (L,) -> (bonus E (L,), clusters per leaf's group (L,)). A leaf in a
    cluster of n_m of its group's N valid leaves gets sqrt(N / n_m); an invalid leaf gets 0."""
    flat = features.flatten(1).double()
    bonus = torch.zeros(len(groups), dtype=torch.float64)
    clusters = torch.zeros(len(groups), dtype=torch.float64)
    for g in groups.unique().tolist():
        idx = ((groups == g) & valid).nonzero().flatten()
        if len(idx) == 0:
            continue
        labels = spectral_clusters(torch.cdist(flat[idx], flat[idx]), max_clusters)
        sizes = torch.bincount(labels).double()
        bonus[idx] = torch.sqrt(len(idx) / sizes[labels])
        clusters[idx] = float(len(sizes))
    return bonus.float(), clusters.float()


class DiverseGRPO(FlowGRPO):
    """A variant of Flow-GRPO: its plan and PPO-clip objective, with the creativity bonus in the reward and the
    early-step mean-matching regulariser in place of the KL (the module docstring has the rule)."""

    Options = DiverseGRPOOptions
    variant_of = FlowGRPO
    fusable_loss_rows = False  # loss_rows rescales the KL into the mean-matching term per step

    def __init__(self, cfg):
        super().__init__(cfg)
        self.sigmas = None

    @classmethod
    def check(cls, cfg) -> None:
        if cfg.sampler.kernel != "flow_grpo":
            raise ConfigError(f"sampler.kernel: diverse_grpo's regulariser undoes the Flow-SDE's KL scale; set "
                              f"sampler.kernel=flow_grpo (not {cfg.sampler.kernel})")
        if cfg.sampler.noise_lowpass:
            raise ConfigError("sampler.noise_lowpass: diverse_grpo's regulariser is the full-rank mean difference; "
                              "set sampler.noise_lowpass=0")
        if cfg.train.kl_untrained_beta > 0:
            raise ConfigError("train.kl_untrained_beta: diverse_grpo replaces the uniform KL by its early-step "
                              "regulariser (train.kl_beta is its weight); set train.kl_untrained_beta=0")
        if cfg.algorithm.reg_steps > cfg.sampler.num_steps:
            raise ConfigError(f"algorithm.reg_steps: {cfg.algorithm.reg_steps} is more than sampler.num_steps "
                              f"({cfg.sampler.num_steps})")

    def check_inputs(self, rewards, prompts=None) -> None:
        """With ``embedder``: load it now (a missing model fails before any work) and have the reward set embed
        every rollout image beside its scores."""
        if self.opts.embedder:
            from ..rewards.embedding import image_embedder

            rewards.embed_images_with(image_embedder(self.opts.embedder))

    def reg_steps(self) -> int:
        t = self.cfg.sampler.num_steps
        return math.ceil(t / 3) if self.opts.reg_steps < 0 else self.opts.reg_steps

    def plan(self, it, rng=None, sigmas=None):
        if sigmas is not None:
            self.sigmas = sigmas.detach().double().cpu()  # the grid the regulariser's scale is read from
        return super().plan(it, rng, sigmas)

    def reward_advantages(self, tree, scores, weights, it, prompts=None):
        """The advantages of the quality reward plus the creativity bonus, z-scored per group as Flow-GRPO's."""
        quality = torch.where(scores.invalid, torch.nan, scores.total)  # (L,)
        features = scores.features if scores.features is not None else tree.leaves.cpu()  # (L, D) / (L, C, H, W)
        bonus, clusters = creativity_bonus(features, tree.leaf_group, torch.isfinite(quality), self.opts.max_clusters)
        node_adv, keep, stats = self.advantages(tree, quality + self.opts.creativity_beta * bonus, it, prompts)
        ok = torch.isfinite(quality)
        # the groups' diversity as the hacking guard measures it on held-out prompts (guard/diversity), with the
        # same normalised embeddings where guard.diversity_embedder is this method's embedder
        embedded = F.normalize(features.flatten(1).float(), dim=-1) if scores.features is not None else None
        stats.update({"diverse_bonus": float(bonus[ok].mean()), "diverse_clusters": float(clusters[ok].mean())})
        if embedded is not None:
            stats["diverse_diversity"] = group_diversity(embedded[ok], tree.leaf_group.cpu()[ok])
        return node_adv, keep, stats

    def mean_matching_scale(self, step: torch.Tensor) -> torch.Tensor:
        """(R,) grid indices -> (R,) the factor that turns each row's KL into ``mean (mu - mu_ref)^2``: the KL's
        ``2 std^2`` (its std as ``train.kl_std`` sets it) on the first K steps, 0 after them."""
        s = self.sigmas
        a, s_one = self.cfg.sampler.noise_level, float(s[1])
        scale = []
        for i in step.tolist():
            g = flow_grpo_noise_scale(float(s[i]), s_one, a)
            std = g * math.sqrt(float(s[i] - s[i + 1])) if self.cfg.train.kl_std == "transition" else g
            scale.append(2 * std ** 2 if i < self.reg_steps() else 0.0)
        return torch.tensor(scale, dtype=torch.float32, device=step.device)

    def loss_rows(self, items, log_prob, old_log_prob, adv, kl, step):
        """Flow-GRPO's rows with the KL replaced by the mean-matching regulariser of the early steps."""
        return log_prob - old_log_prob, adv, kl * self.mean_matching_scale(step), step
