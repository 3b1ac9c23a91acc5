"""The reward-hacking guard: each signal by hand, no false alarm on the shipped tiny models, and the callback's
trigger, metrics and restore in a run."""

from __future__ import annotations

import json
import math

import pytest
import torch

from flowrl import report
from flowrl.config import load_config
from flowrl.guard import (diversity, image_drift, periodic_artifact_score, pixel_embeddings, violations)
from flowrl.trainer import Trainer


def smooth_images(n: int = 8, size: int = 256, seed: int = 0) -> torch.Tensor:
    """(n, 3, size, size) smooth random images in [0, 1] (bicubic upsampling of 16 x 16 noise)."""
    g = torch.Generator().manual_seed(seed)
    low = torch.rand(n, 3, 16, 16, generator=g)
    return torch.nn.functional.interpolate(low, size=(size, size), mode="bicubic", align_corners=False).clamp(0, 1)


def with_grid(images: torch.Tensor, period: int, amplitude: float) -> torch.Tensor:
    """One-pixel lines every ``period`` px in both directions, ``amplitude`` brighter."""
    grid = torch.zeros(images.shape[-2:])
    grid[::period, :] = 1.0
    grid[:, ::period] = 1.0
    return (images + amplitude * grid).clamp(0, 1)


def test_a_16_px_grid_at_2_percent_stands_out_of_clean_images():
    clean = smooth_images()
    hacked = with_grid(clean, 16, 0.02)
    s_clean, s_grid = periodic_artifact_score(clean, 16), periodic_artifact_score(hacked, 16)
    assert abs(s_clean) < 0.15  # a smooth spectrum: no peak at the harmonics
    assert s_grid - s_clean > 0.6  # separated by more than the default guard.artifact_rise (0.5)
    assert periodic_artifact_score(with_grid(clean, 16, 0.05), 16) > s_grid  # more amplitude, a higher score


def test_the_artifact_score_by_hand_on_a_pure_cosine():
    """One cosine at the period's fundamental along x: power only at k = n / period, so the log ratio along x is
    log(peak / 1e-12-ish background); along y there is no variation at all (both 0 + 1e-12: log 1 = 0)."""
    n, period = 64, 16
    x = torch.arange(n, dtype=torch.float64)
    wave = 0.5 + 0.1 * torch.cos(2 * math.pi * x / period)
    image = wave.expand(n, n).float().expand(1, 3, n, n)
    power = (0.1 * n / 2) ** 2 * n / n  # |rfft|^2 of the cosine along x, averaged over the n identical rows
    expected_x = math.log((power + 1e-12) / 1e-12)
    score = periodic_artifact_score(image, period)
    assert score == pytest.approx((expected_x + 0.0) / 2, rel=0.05)


def test_diversity_of_identical_samples_is_zero_and_of_two_by_hand():
    same = torch.full((4, 3, 32, 32), 0.3)
    assert diversity(pixel_embeddings(same), 1) == 0.0
    a, b = torch.zeros(1, 3, 32, 32), torch.ones(1, 3, 32, 32)
    # two images differing by 1 everywhere: RMS pixel difference 1 (distance / sqrt(D))
    assert diversity(pixel_embeddings(torch.cat([a, b])), 1) == pytest.approx(1.0)
    # two prompts: one pair identical (0), one at distance 1 -> mean 0.5
    assert diversity(pixel_embeddings(torch.cat([a, a, a, b])), 2) == pytest.approx(0.5)


def test_image_drift_by_hand():
    x = torch.zeros(1, 3, 4, 4)
    x[:, 0, :2] = 1.0  # the top half pure red: gray 1/3, saturation 1
    x[:, :, 3] = 1.0  # the last row white: gray 1, saturation 0
    d = image_drift(x)
    assert d["brightness"] == pytest.approx((8 * 1 / 3 + 4 * 1.0) / 16)
    assert d["saturation"] == pytest.approx(8 / 16)
    assert d["dark_fraction"] == pytest.approx(4 / 16) and d["blown_fraction"] == pytest.approx(4 / 16)
    # the soft edge: gray 0.05 counts half dark, 0.1 not at all; 0.95 half blown-out
    for gray, dark, blown in ((0.05, 0.5, 0.0), (0.1, 0.0, 0.0), (0.025, 0.75, 0.0), (0.95, 0.0, 0.5), (0.9, 0.0, 0.0)):
        d = image_drift(torch.full((1, 3, 2, 2), gray))
        assert (d["dark_fraction"], d["blown_fraction"]) == (pytest.approx(dark), pytest.approx(blown)), gray


def test_each_signal_triggers_past_its_tolerance_and_not_before():
    g = load_config(None, []).guard
    start = {"period": 16, "artifacts": 0.1, "diversity": 0.2, "brightness": 0.5, "saturation": 0.4,
             "dark_fraction": 0.0, "blown_fraction": 0.0, "watched": {"hpsv2": (0.30, 0.01)}}
    assert violations(start, start, g) == []
    inside = dict(start, artifacts=0.55, diversity=0.11, brightness=0.64, watched={"hpsv2": (0.271, 0.01)})
    assert violations(inside, start, g) == []
    for change, word in ((dict(artifacts=0.7), "periodic artifacts"), (dict(diversity=0.09), "diversity"),
                         (dict(brightness=0.66), "brightness"), (dict(dark_fraction=0.2), "dark fraction"),
                         (dict(watched={"hpsv2": (0.269, 0.01)}), "watched reward hpsv2")):
        (problem,) = violations(dict(start, **change), start, g)
        assert problem.startswith(word), problem


@pytest.mark.parametrize("preset", ["configs/tiny_default.yaml", "configs/tiny_video_default.yaml"])
def test_no_false_alarm_on_the_shipped_tiny_models(preset):
    """The untrained models measured on two disjoint seed sets (the spread between two checks with nothing
    trained) stay inside every tolerance."""
    from flowrl.callbacks import RewardHackingGuard
    from flowrl.models import load_adapter
    from flowrl.prompts import PromptSource
    from flowrl.sampling import Sampler

    cfg = load_config(preset, [])

    class Fake:  # what the guard reads of a trainer
        class policy:
            @staticmethod
            def ema_weights():
                import contextlib
                return contextlib.nullcontext()

        class procs:
            is_main = True

            @staticmethod
            def broadcast(x):
                return x

    fake = Fake()
    fake.cfg, fake.adapter = cfg, load_adapter(cfg.model)
    fake.eval_sampler, fake.prompts = Sampler(cfg, fake.adapter), PromptSource.from_config(cfg.data, 0, cfg.model)
    first = RewardHackingGuard(cfg)
    second = RewardHackingGuard(cfg.model_copy(update={"guard": cfg.guard.model_copy(update={"seeds": [10, 11, 12, 13]})}))
    a, b = first.measure(fake), second.measure(fake)
    assert violations(b, a, cfg.guard) == [] and violations(a, b, cfg.guard) == []
    assert a["diversity"] > 0


def guarded_run(tmp_path, name, *extra):
    cfg = load_config("configs/tiny_jpeg.yaml", ["train.iterations=2", "guard.every=1", f"log.output_dir={tmp_path}",
                                                 f"log.run_name={name}", "log.progress=false", *extra])
    return Trainer(cfg).train()


@pytest.mark.heavy
def test_the_guard_adds_its_numbers_to_the_metrics_and_warns_in_one_line(tmp_path, capsys):
    run = guarded_run(tmp_path, "warn", "guard.watched=[{name: jpeg_compressibility}]", "guard.drift=1e-9")
    rows = report.read_metrics(run / "metrics.jsonl")
    assert len(rows) == 2 and all(r["guard/triggered"] >= 1 for r in rows)  # drift 1e-9: any move triggers
    for key in ("guard/artifacts", "guard/diversity", "guard/brightness", "guard/watched/jpeg_compressibility",
                "guard/seconds"):
        assert all(math.isfinite(r[key]) for r in rows), key
    state = json.loads((run / "guard.json").read_text())
    assert set(state["start"]) >= {"artifacts", "diversity", "brightness", "watched"} and len(state["checks"]) == 2
    assert (run / "guard.png").stat().st_size > 10_000  # the signals' panel
    err = capsys.readouterr().err
    assert "reward-hacking guard at iteration 1:" in err and "guard.on_trigger=warn: the run goes on" in err


def test_stop_ends_the_run_at_the_first_trigger(tmp_path):
    run = guarded_run(tmp_path, "stop", "guard.on_trigger=stop", "guard.drift=1e-9")
    assert len(report.read_metrics(run / "metrics.jsonl")) == 1  # stopped after iteration 0's check


@pytest.mark.heavy
def test_restore_best_ends_with_the_last_weights_at_which_every_signal_held(tmp_path):
    from safetensors.torch import load_file

    run = guarded_run(tmp_path, "restore", "guard.on_trigger=restore_best", "guard.drift=1e-9", "train.lr=1e-2")
    state = json.loads((run / "guard.json").read_text())
    assert state["restored"] == 0 and state["ok_iteration"] == 0  # the start's weights: no check held after them
    def weights(folder):
        return {k: v for f in sorted(folder.rglob("*.safetensors")) for k, v in load_file(f).items()}

    ok, start = weights(run / "checkpoints" / "guard_ok"), None
    last = weights(sorted((run / "checkpoints").glob("iter_*"))[-1])  # the run's final checkpoint
    assert ok and ok.keys() == last.keys() and all(torch.equal(ok[k], last[k]) for k in ok)  # it ended with them
    from flowrl.models import load_adapter

    start = load_adapter(load_config("configs/tiny_jpeg.yaml", []).model).transformer.state_dict()
    assert all(torch.equal(last[k], start[k].float()) for k in last)  # and they are the untrained weights


def test_a_run_shorter_than_one_check_measures_nothing(tmp_path):
    run = guarded_run(tmp_path, "short", "guard.every=5")
    assert not (run / "guard.json").exists()
    assert not any(k.startswith("guard/") for k in report.read_metrics(run / "metrics.jsonl")[0])
