"""GARDO: diversity-aware advantages, ranks and the KL gate worked by hand; the adaptive reference resets."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_cfg


def test_diversity_advantages_by_hand():
    from flowrl.algorithms.gardo import diversity_advantages

    # one group of three: samples 0 and 2 point almost the same way, sample 1 at right angles to sample 0
    feats = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.1]])
    rewards = torch.tensor([0.9, 0.6, 0.3])
    adv, dist = diversity_advantages(rewards, feats, torch.tensor([0, 0, 0]))
    c = 1 / (1.01 ** 0.5)  # cos(sample 0, sample 2)
    d0, d1, d2 = 1 - c, 1 - 0.1 / 1.01 ** 0.5, 1 - c  # nearest-neighbour cosine distances
    assert dist.tolist() == pytest.approx([d0, d1, d2], abs=1e-6)
    mean_d = (d0 + d1 + d2) / 3
    # mean reward 0.6: samples 0 and 1 are at or above it and are scaled by d / mean d; sample 2 is not
    assert adv.tolist() == pytest.approx([0.3 * d0 / mean_d, 0.0, -0.3], abs=1e-6)
    plain, _ = diversity_advantages(rewards, feats, torch.tensor([0, 0, 0]), diversity=False)
    assert plain.tolist() == pytest.approx([0.3, 0.0, -0.3], abs=1e-6)  # no division by the std


def test_kl_gate_by_hand():
    from flowrl.algorithms.gardo import descending_ranks, kl_gate

    assert descending_ranks(torch.tensor([0.2, 0.9, 0.5])).tolist() == [3.0, 1.0, 2.0]
    main = torch.tensor([0.9, 0.8, 0.7, 0.6, 0.5])  # ranks 1..5
    aux = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5])  # ranks 5..1
    # u = rank_main - rank_aux = [-4, -2, 0, 2, 4]; non-negative u: [0, 2, 4]; their 1 - 0.5 quantile is 2
    gate, u = kl_gate(main, [aux], 0.5)
    assert u.tolist() == [-4.0, -2.0, 0.0, 2.0, 4.0]
    assert gate.tolist() == [False, False, False, False, True]
    gate, _ = kl_gate(main, [aux], 1.0)  # quantile 0: every u above 0
    assert gate.tolist() == [False, False, False, True, True]


def test_refuses_one_reward_and_no_kl():
    from flowrl.config import load_config
    from flowrl.errors import ConfigError

    with pytest.raises(ConfigError, match="add at least one more reward"):
        load_config(None, ["algorithm.name=gardo", "train.kl_beta=0.04"])
    with pytest.raises(ConfigError, match="gardo gates the KL"):
        load_config(None, ["algorithm.name=gardo", "rewards=[{name: jpeg_compressibility}, {name: aesthetic}]"])


def test_reference_resets(tmp_path):
    from flowrl.trainer import Trainer

    cfg = make_cfg(tmp_path, "algorithm.name=gardo", "algorithm.group_size=4", "sampler.num_steps=4",
                   "train.prompts_per_iter=2", "train.kl_beta=0.04", "algorithm.reset_every=1", "train.lr=1e-2",
                   "rewards=[{name: jpeg_incompressibility}, {name: 'tests.helpers:brightness'}]")
    trainer = Trainer(cfg)
    anchor0 = [a.clone() for a in trainer.policy.anchor]
    rows = [trainer.iteration(i) for i in range(3)]
    from flowrl.memory import estimate  # flowrl memory counts the moving reference

    assert estimate(cfg, [1])["per_process_gib"][0]["anchors"] * 1024 == pytest.approx(
        rows[0]["memory/anchors_mb"], rel=1e-6) and rows[0]["memory/anchors_mb"] > 0
    assert rows[0]["ratio_max_abs_dev_first_update"] < 1e-5
    assert [r["gardo_reference_reset"] for r in rows] == [0.0, 1.0, 0.0]  # more than 1 iteration since the reset
    assert 0 < rows[0]["gardo_gated"] < 1
    moved = max(float((a - b).abs().max()) for a, b in zip(trainer.policy.anchor, anchor0))
    assert moved > 0  # the reference is now the weights after iteration 1, not the starting ones
    now = max(float((a - p).abs().max()) for a, p in zip(trainer.policy.anchor, (p.detach() for p in trainer.policy.params)))
    assert now > 0  # iteration 2's update moved the weights past the reset copy


@pytest.fixture(scope="module")
def tiny_dinov2(tmp_path_factory):
    """A DINOv2-architecture backbone with random weights and its image processor, saved as a local folder."""
    from transformers import BitImageProcessor, Dinov2Config, Dinov2Model

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny_dinov2")
    Dinov2Model(Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                             image_size=32, patch_size=8)).save_pretrained(folder)
    BitImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}, do_convert_rgb=True,
                      image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225]).save_pretrained(folder)
    return folder


def test_image_embedder_is_the_backbones_pooled_output(tiny_dinov2):
    from transformers import AutoImageProcessor, AutoModel

    from flowrl.rewards.embedding import ImageEmbedder
    from flowrl.rewards.loading import to_pil

    images = torch.rand(3, 3, 40, 48, generator=torch.Generator().manual_seed(1))
    model, processor = AutoModel.from_pretrained(tiny_dinov2), AutoImageProcessor.from_pretrained(tiny_dinov2)
    with torch.no_grad():
        expected = model(pixel_values=processor(images=to_pil(images), return_tensors="pt")["pixel_values"]).pooler_output
    embed = ImageEmbedder(str(tiny_dinov2), device="cpu")
    got = embed(images)
    assert got.shape == (3, 32)
    assert torch.allclose(got, expected, atol=1e-6)
    videos = images.view(1, 3, 3, 40, 48)  # one video of three frames: the frames' vectors averaged
    assert torch.allclose(embed(videos), expected.mean(0, keepdim=True), atol=1e-6)


def test_image_embedder_takes_a_dual_encoders_projected_image_embedding(tmp_path):
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    from flowrl.rewards.embedding import ImageEmbedder
    from flowrl.rewards.loading import to_pil

    torch.manual_seed(0)
    model = CLIPModel(CLIPConfig(projection_dim=12, text_config=dict(hidden_size=16, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=32, vocab_size=100, bos_token_id=0,
                                 eos_token_id=1),
                                 vision_config=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                                    intermediate_size=32, image_size=32, patch_size=8)))
    processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    images = torch.rand(2, 3, 36, 36, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model.get_image_features(pixel_values=processor(images=to_pil(images), return_tensors="pt")
                                            ["pixel_values"]).pooler_output
    got = ImageEmbedder(str(tmp_path), device="cpu")(images)
    assert got.shape == (2, 12) and torch.allclose(got, expected, atol=1e-6)


def test_reward_set_returns_the_embeddings_with_the_scores(tiny_dinov2):
    from flowrl.errors import RewardError
    from flowrl.rewards.embedding import ImageEmbedder
    from flowrl.rewards.registry import RewardScores, RewardSet

    images = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    rewards = RewardSet([("mean", 1.0, lambda im, p, m: im.mean((1, 2, 3)))])
    assert rewards(images, ["a"] * 4).features is None
    embed = ImageEmbedder(str(tiny_dinov2), device="cpu")
    rewards.embed_images_with(embed)
    parts = [rewards(images[:2], ["a"] * 2), rewards(images[2:], ["a"] * 2)]
    joined = RewardScores.concat(parts)
    assert torch.allclose(joined.features, embed(images), atol=1e-6)  # batches concatenate in order
    assert torch.allclose(joined.total, images.mean((1, 2, 3)))
    rewards.embed_images_with(lambda im: torch.zeros(len(im)))
    with pytest.raises(RewardError, match=r"returned shape \(4,\); it must return one vector per image, shape \(4, D\)"):
        rewards(images, ["a"] * 4)


def test_gardo_measures_diversity_on_the_backbones_embeddings(tmp_path, tiny_dinov2, monkeypatch):
    """algorithm.diversity_model: every rollout image is embedded beside its scores, and the diversity-scaled
    advantages use those vectors (not the latents)."""
    import flowrl.algorithms.gardo as gardo
    from flowrl.rewards.embedding import ImageEmbedder
    from flowrl.trainer import Trainer

    embedded, used = [], []
    call = ImageEmbedder.__call__
    monkeypatch.setattr(ImageEmbedder, "__call__", lambda self, images: embedded.append(call(self, images)) or
                        embedded[-1])
    advantages = gardo.diversity_advantages
    monkeypatch.setattr(gardo, "diversity_advantages", lambda r, f, g, d=True: used.append(f) or advantages(r, f, g, d))
    cfg = make_cfg(tmp_path, "algorithm.name=gardo", "algorithm.group_size=4", "sampler.num_steps=4",
                   "train.prompts_per_iter=2", "train.kl_beta=0.04", "sampler.rollout_batches=2",
                   f"algorithm.diversity_model={tiny_dinov2}",
                   "rewards=[{name: jpeg_incompressibility}, {name: 'tests.helpers:brightness'}]")
    row = Trainer(cfg).iteration(0)
    assert len(embedded) == 2 and used[0].shape == (8, 32)  # two rollout batches of 4 images, DINOv2 width 32
    assert torch.equal(used[0], torch.cat(embedded))
    assert row["ratio_max_abs_dev_first_update"] < 1e-5 and row["gardo_nearest_distance"] > 0


def test_gardo_refuses_a_missing_diversity_model_before_any_work(tmp_path):
    from flowrl.errors import RewardError
    from flowrl.trainer import Trainer

    cfg = make_cfg(tmp_path, "algorithm.name=gardo", "train.kl_beta=0.04", "algorithm.diversity_model=./no/such/dino",
                   "rewards=[{name: jpeg_incompressibility}, {name: 'tests.helpers:brightness'}]")
    with pytest.raises(RewardError, match="no/such/dino is neither a local folder nor a Hugging Face repository id"):
        Trainer(cfg)
    assert not any(tmp_path.rglob("config.yaml"))  # no run folder


def _reset_decisions(algo, stream, rows_per_mb: int, threshold: float) -> list[bool]:
    """Our reset decision per iteration: each micro-batch's KL rows through GARDO.loss_rows, their mean over the
    minibatch (what kl_loss_step_max reads with one minibatch), against the threshold."""
    from flowrl.algorithms.base import Unit

    out = []
    for kls, gates in stream:
        algo.gate_nodes = [None, gates.double()]
        algo.gate_share = float(gates.float().mean())
        rows = []
        for a in range(0, len(kls), rows_per_mb):
            items = [[Unit(0, 0, [c])] for c in range(a, min(a + rows_per_mb, len(kls)))]
            z = torch.zeros(len(items))
            rows.append(algo.loss_rows(items, z, z, z, kls[a:a + rows_per_mb].clone(), z)[2])
        out.append(float(torch.cat(rows).mean()) > threshold)
    return out


def test_the_reset_statistic_is_the_published_mean_over_micro_batches():
    """GARDO's code averages the gated KL within each micro-batch (0 where none is gated), then over micro-batches.
    On a synthetic stream at the published size (1,152 samples in micro-batches of 9, 2.5-4.9% gated, 300
    iterations) the default (micro_batch) takes every reset decision the published rule takes; averaging over the
    gated rows instead (kl_average=gated) is about 4x larger and disagrees often."""
    from flowrl.algorithms.gardo import GARDO
    from flowrl.config import load_config

    cfg = load_config("configs/tiny_shapes_gardo.yaml")
    gen = torch.Generator().manual_seed(0)
    stream = []
    for _ in range(300):
        share = 0.025 + 0.024 * float(torch.rand((), generator=gen))
        gates = torch.rand(1152, generator=gen) < share
        kls = torch.exp(torch.randn(1152, generator=gen) * 0.8) * 2e-3  # per-sample KL, median 2e-3
        stream.append((kls, gates))
    threshold = 7.5e-4  # near the published statistic (about 2.7e-3 x the share of micro-batches with a gated sample)

    def published(kls, gates):  # the code's statistic, written out
        means = []
        for a in range(0, 1152, 9):
            g = gates[a:a + 9]
            means.append(float(kls[a:a + 9][g].mean()) if g.any() else 0.0)
        return sum(means) / len(means) > threshold

    truth = [published(k, g) for k, g in stream]
    ours = _reset_decisions(GARDO(cfg), stream, 9, threshold)
    gated_cfg = load_config("configs/tiny_shapes_gardo.yaml", ["algorithm.kl_average=gated"])
    other = _reset_decisions(GARDO(gated_cfg), stream, 9, threshold)
    agree = sum(a == b for a, b in zip(ours, truth))
    agree_other = sum(a == b for a, b in zip(other, truth))
    print(f"reset decisions agreeing with the published rule: micro_batch {agree}/300, gated {agree_other}/300; "
          f"published resets {sum(truth)}")
    assert agree == 300 and 0 < sum(truth) < 300
    assert agree_other < 300
