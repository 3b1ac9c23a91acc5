"""The shipped tiny pretrained model, the tiny shapes CLIP, and GRPO on them (fast tests; one slow test)."""

import json
from pathlib import Path

import pytest
import torch

from flowrl.config import load_config
from flowrl.trainer import Trainer

from .conftest import make_cfg
from .helpers import run_shipped_job

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "assets"


def test_assets_fit_the_budget():
    total = sum(p.stat().st_size for p in ASSETS.rglob("*") if p.is_file())
    assert total < 45 * 10**6, f"assets are {total / 10**6:.1f} MB; the budget is 45 MB"  # the issues' budget
    assert not list(ASSETS.rglob("*.bin")) and not list(ASSETS.rglob("*.pt")), "weights must be safetensors"
    meta = json.loads((ASSETS / "tiny_shapes" / "pretrain.json").read_text())
    assert meta["command"].startswith("flowrl pretrain-tiny") and meta["wall_time_s"] > 0
    edit = json.loads((ASSETS / "tiny_shapes_edit" / "pretrain.json").read_text())
    assert edit["command"].startswith("flowrl pretrain-tiny-edit") and edit["wall_time_s"] > 0


def test_shipped_model_loads_and_draws_the_background():
    from flowrl.models import SD3Adapter
    from flowrl.sampling import Sampler
    from flowrl.shapes.evaluate import shapes_accuracy

    cfg = load_config(ROOT / "configs" / "tiny_shapes_flow_grpo.yaml")
    adapter = SD3Adapter.from_config(cfg.model)
    assert adapter.pixel_space and adapter.latent_shape(32) == (3, 32, 32)
    result = shapes_accuracy(Sampler(cfg, adapter, num_steps=10), [0])
    assert result["images"] == 24
    assert result["background"] >= 0.9 and result["color"] >= 0.7  # one seed per held-out prompt


def test_shipped_editing_model_edits_and_keeps_the_rest():
    """The shipped tiny editing model (FLUX.1 Kontext architecture, pixel space, pretrained on an imperfect editing
    dataset) on the held-out edit requests, one seed, 10 ODE steps: some edits come out right (15% at this seed; its
    pretraining readout at two seeds: 18%) and most keep the unasked attributes (58%); a random model of its
    architecture edits nothing right and keeps nothing."""
    from flowrl.models import FluxKontextAdapter
    from flowrl.sampling import Sampler
    from flowrl.shapes.editing import edit_accuracy

    cfg = load_config(ROOT / "configs" / "tiny_shapes_edit.yaml")
    adapter = FluxKontextAdapter.from_config(cfg.model)
    assert adapter.pixel_space and adapter.latent_shape(16) == (3, 16, 16)
    result = edit_accuracy(Sampler(cfg, adapter, num_steps=10), [0])
    assert result["images"] == 72
    assert result["edit"] >= 0.1 and result["kept"] >= 0.5, result
    with torch.no_grad():  # the same architecture with random weights edits nothing right
        for p in adapter.transformer.parameters():
            p.normal_(0, 0.02, generator=torch.Generator().manual_seed(0))
    random = edit_accuracy(Sampler(cfg, adapter, num_steps=10), [0])
    assert random["edit"] < 0.05 and random["kept"] < 0.1, random


def test_one_grpo_iteration_on_shipped_model(tmp_path):
    cfg = make_cfg(tmp_path, "model.pretrained=tiny-shapes", "model.resolution=32", "rewards=[{name: shapes}]",
                   "data.prompt_set=shapes-train", "train.prompts_per_iter=2", "algorithm.group_size=4",
                   "sampler.num_steps=4")
    row = Trainer(cfg).iteration(0)
    assert 0.3 < row["reward_mean/shapes"] <= 1.0
    assert row["ratio_max_abs_dev_first_update"] < 1e-5


@pytest.mark.heavy
def test_heldout_curve_counts_the_work_spent(tmp_path):
    """log.eval_every writes held-out points with the rollouts spent so far; AdaGRPO's candidate anchors count."""
    from flowrl.report import read_metrics

    cfg = make_cfg(tmp_path, "model.pretrained=tiny-shapes", "model.resolution=32", "rewards=[{name: shapes}]",
                   "data.prompt_set=shapes-train", "sampler.num_steps=4", "algorithm.name=ada_grpo",
                   "algorithm.group_size=2", "algorithm.steps=[0]", "algorithm.candidates=3",
                   "train.prompts_per_iter=2", "train.iterations=2", "log.eval=shapes", "log.eval_seeds=[0, 1]",
                   "log.eval_curve_seeds=1", "log.eval_every=1")
    run = Trainer(cfg).train()
    curve, rows = read_metrics(run / "eval_curve.jsonl"), read_metrics(run / "metrics.jsonl")
    assert [c["iteration"] for c in curve] == [0, 1, 2] and {c["images"] for c in curve} == {24}
    assert all(c["seconds_curve_point"] > 0 for c in curve)  # each point's own sampling time, for the curve's share
    assert all(r["curriculum/nfe"] == 3 * 4 for r in rows)  # 3 candidates x one 4-step ODE anchor
    for c in curve[1:]:
        done = rows[: c["iteration"]]
        assert c["nfe_rollout_cum"] == sum(r["nfe_rollout"] + 12 for r in done)
        assert c["rollouts_cum"] == sum(r["leaves"] + 3 for r in done) == c["iteration"] * (2 * 2 + 3)
    # the first point is the untouched model on seed 0 alone: a full evaluation with eval_seeds=[0] agrees
    from flowrl.sampling import Sampler
    from flowrl.shapes.evaluate import shapes_accuracy

    t = Trainer(make_cfg(tmp_path, "model.pretrained=tiny-shapes", "model.resolution=32", "sampler.num_steps=4",
                         "rewards=[{name: shapes}]", "data.prompt_set=shapes-train", "log.run_name=u"))
    again = shapes_accuracy(Sampler(t.cfg, t.adapter), [0])
    assert curve[0]["all"] == again["all"] and curve[0]["reward"] == again["reward"]
    assert (run / "reward_curve.png").stat().st_size > 0
    from flowrl.report import compare_runs

    _, _, (summary,) = compare_runs([run], tmp_path / "cmp", "rollouts", "heldout/all")
    assert summary["start"] == curve[0]["all"] and summary["final_mean"] == curve[-1]["all"]
    assert summary["rollouts_spent"] == curve[-1]["rollouts_cum"] == 14


@pytest.mark.heavy
def test_pretraining_continues_from_an_exported_model(tmp_path):
    """`flowrl pretrain-tiny --init-from`: zero further steps export the source's weights unchanged (fp16 both ways)
    with the lineage recorded; a few steps write held-out readouts; another architecture is refused in one line."""
    from safetensors.torch import load_file

    from flowrl.errors import FlowRLError
    from flowrl.shapes.pretrain import pretrain_tiny

    src = ASSETS / "tiny_shapes"
    out = pretrain_tiny(tmp_path / "w0", steps=0, init_from=src, export_dir=tmp_path / "e0", progress=False)
    for name in ("transformer/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors"):
        a, b = load_file(str(src / name)), load_file(str(out / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    meta = json.loads((out / "pretrain.json").read_text())
    assert meta["init_from"] == str(src) and meta["parent"]["steps"] == json.loads((src / "pretrain.json").read_text())["steps"]
    pretrain_tiny(tmp_path / "w1", steps=2, eval_every=2, init_from=src, export_dir=tmp_path / "e1", progress=False,
                  grid_every=100)
    (record,) = [json.loads(line) for line in (tmp_path / "w1" / "progress.jsonl").read_text().splitlines()]
    assert record["step"] == 2 and 0.3 < record["all"] <= 1 and set(record["per_shape"]) == {"circle", "square", "triangle", "cross"}
    with pytest.raises(FlowRLError, match="--init-from"):
        pretrain_tiny(tmp_path / "w2", steps=0, init_from=ASSETS / "tiny_moving_shapes", export_dir=tmp_path / "e2",
                      progress=False)
    assert not (tmp_path / "e2").exists()


def test_pretraining_samples_the_ema_and_keeps_training_every_component():
    """A grid or readout during pretraining samples the EMA weights through an adapter, which freezes the text
    encoders; afterwards the trained weights are back and every component trains again."""
    from diffusers.training_utils import EMAModel

    from flowrl.shapes.image_model import load_tiny_shapes_pipeline
    from flowrl.shapes.pretrain import COMPONENTS, sampling_ema_weights

    pipe = load_tiny_shapes_pipeline()
    params = [p for name in COMPONENTS for p in getattr(pipe, name).parameters()]
    ema = EMAModel(params, decay=0.999)
    trained = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.add_(1.0)  # the trained copy moves away from the EMA
    with sampling_ema_weights(pipe, params, ema) as adapter:
        assert adapter.pipe is pipe and not any(p.requires_grad for p in pipe.text_encoder.parameters())
        assert all(torch.equal(p, t) for p, t in zip(params, trained))  # sampling sees the EMA weights
    assert all(torch.equal(p, t + 1.0) for p, t in zip(params, trained))
    assert all(p.requires_grad for p in params)
    assert all(getattr(pipe, name).training for name in COMPONENTS)


def test_tiny_clip_scores_matching_captions_higher():
    import numpy as np
    from flowrl.rewards import build_reward

    from flowrl.shapes.domain import ShapeSpec, render

    clip = build_reward("clip")
    img = torch.from_numpy(np.stack([render(ShapeSpec("square", "red", "blue"), 32, 5)] * 2)).permute(0, 3, 1, 2) / 255
    s = clip(img, ["a red square on a blue background", "a green circle on a yellow background"])
    assert s[0] > s[1]
    meta = json.loads((ASSETS / "tiny_clip" / "open_clip_config.json").read_text())
    assert meta["training"]["retrieval_top1_heldout"] > 0.5


@pytest.mark.slow
def test_main_job_raises_heldout_accuracy(tmp_path):
    """The main job exactly as shipped (configs/tiny_default.yaml, about 15 minutes alone on two cores): held-out
    all-three accuracy and held-out reward after fine-tuning beat the shipped model's (measured on three training
    seeds: see README) without dirtying the backgrounds by more than the stated margin, and the run writes its
    curve and before | after grid."""
    run, ev = run_shipped_job("tiny_default.yaml", tmp_path)
    assert ev["after"]["all"] > ev["before"]["all"] + 0.10, ev  # the smallest of five seeds' gains: +13.8
    assert ev["after"]["reward"] > ev["before"]["reward"], ev
    # the two KLs keep the backgrounds clean: the stated margin is 1.5 (seeds 0-4: +0.26 / +0.64 / +0.95 / +0.58 /
    # +0.73; gains +16.1 / +22.1 / +18.0 / +13.8 / +14.1 points; with the trained step's KL alone at 150 iterations,
    # lr 1e-4, seeds 0-4: +1.2 / -0.1 / +0.8 / +1.5 / +1.7)
    assert ev["after"]["background_noise"] - ev["before"]["background_noise"] < 1.5, ev
    for name in ("reward_curve.png", "before_after.png", "metrics.jsonl"):
        assert (run / name).is_file()

