"""DiverseGRPO: the spectral clusters and creativity bonus on hand-made groups, the regulariser's scale from the
Flow-SDE's std by hand (the KL times it is the mean squared difference of the two transition means), and one
training iteration on the tiny model whose first update has ratio 1."""

import math

import pytest
import torch
from flowrl.samplers.kernels import step as kernel_step

from flowrl.algorithms import make_algorithm
from flowrl.algorithms.diverse_grpo import creativity_bonus, spectral_clusters
from flowrl.config import load_config
from flowrl.errors import ConfigError
from flowrl.losses import gaussian_kl_same_std
from tests.conftest import make_cfg


def _blobs(sizes: list[int], spread: float = 0.01, gap: float = 10.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.cat([gap * i + spread * torch.randn(n, 4, generator=g) for i, n in enumerate(sizes)])


def test_two_separated_blobs_are_two_clusters_and_their_bonus_is_sqrt_n_over_size():
    points = _blobs([3, 5])
    labels = spectral_clusters(torch.cdist(points, points), max_clusters=4)
    assert len(set(labels[:3].tolist())) == 1 and len(set(labels[3:].tolist())) == 1 and labels[0] != labels[3]
    bonus, clusters = creativity_bonus(points, torch.zeros(8, dtype=torch.long), torch.ones(8, dtype=torch.bool), 4)
    assert torch.allclose(bonus[:3], torch.full((3,), math.sqrt(8 / 3)))
    assert torch.allclose(bonus[3:], torch.full((5,), math.sqrt(8 / 5)))
    assert clusters.tolist() == [2.0] * 8


def test_identical_samples_are_one_cluster_with_bonus_one_and_invalid_samples_get_none():
    points = torch.ones(6, 4)
    bonus, _ = creativity_bonus(points, torch.zeros(6, dtype=torch.long), torch.ones(6, dtype=torch.bool), 0)
    assert torch.equal(bonus, torch.ones(6))
    valid = torch.tensor([True] * 5 + [False])
    bonus, _ = creativity_bonus(_blobs([2, 4]), torch.zeros(6, dtype=torch.long), valid, 3)
    assert bonus[5] == 0 and torch.allclose(bonus[:2], torch.full((2,), math.sqrt(5 / 2)))


def test_the_regulariser_is_the_mean_squared_mean_difference_on_the_first_k_steps_only():
    cfg = load_config("configs/tiny_shapes_diverse_grpo.yaml", ["algorithm.reg_steps=2"])
    algo = make_algorithm(cfg)
    sigmas = torch.linspace(1, 0, 11)
    algo.plan(0, sigmas=sigmas)
    g = torch.Generator().manual_seed(3)
    x, v, v_ref = (torch.randn(2, 3, 8, 8, generator=g) for _ in range(3))
    for i in (0, 1, 2, 5):
        s, s_next = sigmas[i].expand(2), sigmas[i + 1].expand(2)
        out = kernel_step("flow_grpo", x, v, s, s_next, noise_level=0.7, sigma_at_one=float(sigmas[1]), prev_sample=x)
        ref = kernel_step("flow_grpo", x, v_ref, s, s_next, noise_level=0.7, sigma_at_one=float(sigmas[1]),
                          prev_sample=x)
        kl = gaussian_kl_same_std(out.mean, ref.mean, out.std)  # the objective's KL (train.kl_std=transition)
        reg = kl * algo.mean_matching_scale(torch.tensor([i, i]))
        want = ((out.mean - ref.mean) ** 2).mean(dim=(1, 2, 3)) if i < 2 else torch.zeros(2)
        assert torch.allclose(reg, want, rtol=1e-5, atol=1e-12), i


def test_settings_it_cannot_use_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="train.kl_untrained_beta: diverse_grpo replaces the uniform KL"):
        load_config("configs/tiny_default.yaml", ["algorithm.name=diverse_grpo", "sampler.noise_lowpass=0"])
    with pytest.raises(ConfigError, match="sampler.noise_lowpass"):
        load_config("configs/tiny_default.yaml", ["algorithm.name=diverse_grpo", "train.kl_untrained_beta=0"])


def test_one_iteration_adds_the_bonus_and_starts_at_ratio_one(tmp_path):
    from flowrl.trainer import Trainer

    cfg = make_cfg(tmp_path, "algorithm.name=diverse_grpo", "algorithm.group_size=4", "train.kl_beta=0.5",
                   "train.iterations=1", "log.eval_every=0", "guard.enabled=false")
    row = Trainer(cfg).iteration(0)
    assert 1.0 <= row["diverse_bonus"] <= 2.0 and row["diverse_clusters"] >= 1.0  # sqrt(4 / n) for n in 1..4
    assert row["ratio_max_abs_dev_first_update"] < 1e-5


def test_the_tiny_clip_features_cluster_and_the_groups_diversity_is_the_guards_measure(tmp_path):
    """With ``embedder: tiny-clip`` (the shapes domain's feature model) the reward set embeds every rollout image
    with the shipped CLIP, and ``diverse_diversity`` is the hacking guard's diversity of those normalised
    embeddings, recomputed here from the iteration's own images."""
    from flowrl.guard import diversity
    from flowrl.rewards.embedding import image_embedder
    from flowrl.trainer import Trainer

    cfg = make_cfg(tmp_path, "algorithm.name=diverse_grpo", "algorithm.group_size=4", "algorithm.embedder=tiny-clip",
                   "train.prompts_per_iter=2", "train.iterations=1", "log.eval_every=0", "guard.enabled=false")
    tr = Trainer(cfg)
    seen = {}
    embed = tr.rewards.embedder
    tr.rewards.embed_images_with(lambda images: seen.setdefault("f", embed(images)))
    row = tr.iteration(0)
    features = seen["f"]  # (8, 64): 2 prompts x 4 samples, prompt-major
    assert features.shape == (8, 64)
    hand = diversity(torch.nn.functional.normalize(features, dim=-1), 2)
    assert row["diverse_diversity"] == pytest.approx(hand, rel=1e-9) and hand > 0
    same = image_embedder("tiny-clip")(torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(0)))
    assert same.shape == (3, 64) and torch.allclose(same.norm(dim=-1), torch.ones(3), atol=1e-5)
