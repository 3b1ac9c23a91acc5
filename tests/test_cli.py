"""End-to-end CLI on the tiny model: train writes every artifact; sample, compare and bench work."""

import json
from pathlib import Path

import pytest
import torch

from flowrl.cli import main
from flowrl.report import read_metrics

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    dirs = []
    for seed in (0, 1):
        code = main(["train", str(ROOT / "configs/tiny_flow_grpo.yaml"), f"log.output_dir={root}", f"log.run_name=cli-seed{seed}",
                     f"train.seed={seed}", "train.iterations=3", "log.save_every=2", "log.sample_every=2",
                     "sampler.num_steps=4", "log.progress=false"])
        assert code == 0
        dirs.append(root / f"cli-seed{seed}")
    return dirs


def test_train_artifacts(run_dirs):
    d = run_dirs[0]
    for name in ["config.yaml", "metrics.jsonl", "reward_curve.png", "samples/iter_00000.png", "samples/iter_00002.png",
                 "samples/iter_00003.png", "checkpoints/iter_00001/state.json", "checkpoints/iter_00002/trainer_state.pt"]:
        assert (d / name).is_file(), name
    rows = read_metrics(d / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert rows[0]["ratio_max_abs_dev_first_update"] < 1e-5
    assert not list(d.glob("**/.*tmp*")), "temporary files left behind"


def test_sample_base_and_checkpoint(run_dirs, tmp_path, capsys):
    out = tmp_path / "grid.png"
    code = main(["sample", "--checkpoint", str(run_dirs[0]), "--seeds", "0,1", "--prompt", "a red circle on a blue background",
                 "--out", str(out)])
    assert code == 0 and out.is_file()
    report = json.loads(capsys.readouterr().out)
    assert report["seeds"] == [0, 1] and report["columns"] == 4  # base | fine-tuned, side by side


def test_compare_with_seed_band(run_dirs, tmp_path, capsys):
    code = main(["compare", *map(str, run_dirs), "--x", "nfe", "--smoothing", "2", "--out", str(tmp_path / "cmp")])
    assert code == 0
    csv_text = (tmp_path / "cmp" / "compare.csv").read_text().splitlines()
    assert csv_text[0] == "run,label,seed,nfe,reward_mean/total"
    assert len(csv_text) == 1 + 6
    assert {line.split(",")[1] for line in csv_text[1:]} == {"cli"}  # both seeds form one band
    assert (tmp_path / "cmp" / "compare.png").is_file()
    (summary,) = json.loads(capsys.readouterr().out)["summary"]
    series = {}
    for line in csv_text[1:]:
        _, _, seed, x, y = line.split(",")
        series.setdefault(int(seed), []).append((float(x), float(y)))
    finals = [series[s][-1][1] for s in (0, 1)]
    assert summary["seeds"] == [0, 1] and abs(summary["final_mean"] - sum(finals) / 2) < 1e-4
    target = sum(finals) / 2  # the first (only) label is its own reference: each seed's first x at or above it
    assert summary["reach_nfe"] == [next((x for x, y in series[s] if y >= target), None) for s in (0, 1)]
    assert summary["nfe_spent"] == sum(series[s][-1][0] for s in (0, 1)) / 2


def test_bench_prints_json(capsys, tmp_path):
    code = main(["bench", str(ROOT / "configs/tiny_flow_grpo.yaml"), "sampler.num_steps=4", "train.prompts_per_iter=2",
                 "sampler.max_batch=16"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["nfe_rollout_per_leaf"] == 4.0
    assert out["rollout_max_batch_1"]["transformer_calls"] == 4 * 16
    assert out["rollout_batched"]["transformer_calls"] == 4
    assert out["speedup_batched_vs_1"] > 0
    # the transformer clock: the measured iteration's 4 rollout calls plus its training forwards (one per micro-batch)
    assert out["transformer_forward_calls"] >= 4 + out["nfe_train"] // 64
    assert 0 < out["seconds_transformer_forward"] and 0 < out["seconds_transformer_backward"]
    assert out["seconds_transformer"] <= out["seconds_iteration_wall"] and out["iteration_vs_transformer"] >= 1


def test_eval_reward_table_is_reproducible(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a red circle on a blue background", "tag": "circle"}\n\n'
                       '{"prompt": "a green square on a white background", "tag": "square"}\n')
    args = ["eval", str(ROOT / "configs/tiny_flow_grpo.yaml"), "log.progress=false", "--prompts", str(prompts),
            "--reward", "jpeg_incompressibility", "--reward", "tests.helpers:brightness", "--seeds", "0,1,2"]
    outs = []
    for k in range(2):
        assert main(args + ["--csv", str(tmp_path / f"e{k}.csv")]) == 0
        outs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert outs[0]["metrics"] == outs[1]["metrics"]  # same prompts and seeds -> same numbers
    assert set(outs[0]["metrics"]) == {"jpeg_incompressibility", "brightness", "total"}
    import csv

    with open(tmp_path / "e0_samples.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 6 and rows[0]["seed"] == "0"
    bright = [float(r["brightness"]) for r in rows]
    mean, std = outs[0]["metrics"]["brightness"]["mean"], outs[0]["metrics"]["brightness"]["std"]
    assert abs(mean - sum(bright) / 6) < 1e-5
    assert abs(std - (sum((b - sum(bright) / 6) ** 2 for b in bright) / 5) ** 0.5) < 1e-5  # ddof 1


def test_eval_bad_prompt_file_is_one_clear_line(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    assert main(["eval", str(ROOT / "configs/tiny_flow_grpo.yaml"), "--prompts", str(empty), "--reward", "jpeg_incompressibility",
                 "--csv", str(tmp_path / "e.csv")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("flowrl: error: --prompts") and "no prompts" in err[-1]
    assert not (tmp_path / "e.csv").exists()
    assert main(["eval", "--prompts", str(tmp_path / "missing.txt"), "--reward", "clip"]) == 2
    assert "file not found" in capsys.readouterr().err


def test_sample_and_eval_load_a_full_fine_tuning_checkpoint(tmp_path, capsys):
    """`make demo` writes full fine-tuning checkpoints: sample and eval load them, the latest or a chosen one."""
    from safetensors.torch import load_file

    from flowrl.policy import load_trained_weights
    from flowrl.config import load_config
    from flowrl.models import load_adapter

    assert main(["train", str(ROOT / "configs/tiny_flow_grpo.yaml"), f"log.output_dir={tmp_path}", "log.run_name=full",
                 "train.lora.enabled=false", "train.iterations=2", "log.save_every=1", "sampler.num_steps=3",
                 "train.prompts_per_iter=1", "log.progress=false", "train.lr=1e-2"]) == 0
    run = tmp_path / "full"
    capsys.readouterr()
    grids = {}
    for it in (0, 1):
        out = tmp_path / f"g{it}.png"
        assert main(["sample", "--checkpoint", str(run), "--iteration", str(it), "--seeds", "0",
                     "--out", str(out), "--steps", "3"]) == 0
        info = json.loads(capsys.readouterr().out)
        assert info["checkpoint"].endswith(f"iter_0000{it}") and out.stat().st_size > 0
        grids[it] = out.read_bytes()
    assert grids[0] != grids[1]  # two different fine-tuned states
    # the weights the CLI loads are the checkpoint's, exactly
    cfg = load_config(run / "config.yaml")
    adapter = load_adapter(cfg.model)
    before = {k: v.clone() for k, v in adapter.transformer.state_dict().items()}
    load_trained_weights(adapter, cfg, run / "checkpoints" / "iter_00001")
    saved = load_file(str(next((run / "checkpoints" / "iter_00001" / "transformer").glob("*.safetensors"))))
    loaded = adapter.transformer.state_dict()
    assert all(loaded[k].equal(saved[k].to(loaded[k].dtype)) for k in saved)
    assert any(not before[k].equal(loaded[k]) for k in saved)
    # a missing iteration and an existing output are one clear line each
    assert main(["sample", "--checkpoint", str(run), "--iteration", "7", "--out", str(tmp_path / "x.png")]) == 2
    assert "no checkpoint at iteration 7; saved: [0, 1]" in capsys.readouterr().err
    assert main(["sample", "--checkpoint", str(run), "--out", str(tmp_path / "g0.png")]) == 2
    assert "exists; choose another path or pass --overwrite" in capsys.readouterr().err
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle on a blue background\n")
    assert main(["eval", "--checkpoint", str(run), "--iteration", "0", "--prompts", str(prompts), "--reward",
                 "tests.helpers:brightness", "--seeds", "0", "--steps", "3", "--csv", str(tmp_path / "e.csv")]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["checkpoint"].endswith("iter_00000")


def test_bench_memory_prints_the_rss_slope(capsys):
    """`flowrl bench --memory N` trains N iterations in a temporary folder and fits the resident memory of the second
    half: the numbers are there and consistent (the slope is measured, not asserted: bench prints, tests do not time)."""
    import json

    from flowrl.cli import main

    assert main(["bench", "train.prompts_per_iter=1", "algorithm.group_size=2", "sampler.num_steps=2",
                 "log.progress=false", "--memory", "6"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["iterations"] == 6 and 0 < out["rss_mb_first"] and 0 < out["rss_mb_last"]
    assert isinstance(out["rss_slope_mb_per_100_iterations"], float) and out["slope_stderr_mb_per_100_iterations"] >= 0


def test_bench_gpu_runs_its_code_path_on_tiny_models():
    """`flowrl bench-gpu --tiny`: the GPU benchmark's update step and rollouts on shrunken SD3.5-M / FLUX.1 layouts
    (the timings are printed, not asserted); the FLOP counts are measured, rollout FLOPs are one call's per latent
    times the evaluations, and the tree saves evaluations; each row reaches ``emit`` as it is measured."""
    from flowrl.gpu_bench import forward_flops_per_row, run_gpu_bench

    emitted = []
    rows = run_gpu_bench(("sd35m", "flux1"), (64,), batch=2, prompts=1, tiny=True, device="cpu", emit=emitted.append,
                         compiled=False, peak_tflops=0.5)
    assert [json.loads(line) for line in emitted] == rows
    assert [(r["family"], r["case"]) for r in rows] == [
        (f, c) for f in ("sd35m", "flux1")
        for c in ("update", "update unfused-adamw", "update checkpointing", "rollout flat", "rollout tree")]
    for r in rows:
        assert r["seconds"] > 0 and r["images_per_s"] > 0 and r["mfu"] == pytest.approx(r["achieved_tflops"] / 0.5, abs=0.0005 / 0.5 + 1e-4)  # both rounded
        if r["case"].startswith("update"):
            assert r["gflop_per_step"] > 0 and r["batch"] == 2
    assert rows[2]["gflop_per_step"] == rows[0]["gflop_per_step"]  # recomputation under checkpointing not credited
    flat, tree = rows[3], rows[4]  # 16 chains x 20 steps vs branch 2 at steps 0, 3, 6, 9: 1+2*3+4*3+8*3+16*10
    assert (flat["nfe"], tree["nfe"], flat["leaves"], tree["leaves"]) == (320, 203, 16, 16)
    from flowrl.gpu_bench import build

    per_row = forward_flops_per_row(build("sd35m", torch.device("cpu"), tiny=True), 64, tiny=True)
    assert tree["gflop_per_nfe"] == round(per_row / 1e9, 4) > 0
    assert tree["achieved_tflops"] == pytest.approx(per_row * 203 / tree["seconds"] / 1e12, rel=1e-2, abs=1e-3)


@pytest.mark.slow  # about 40 s of compilation on two cores (make test-slow)
def test_bench_gpu_times_the_compiled_blocks_with_the_eager_step_s_flops():
    from flowrl.gpu_bench import run_gpu_bench

    rows = run_gpu_bench(("sd35m",), (32,), batch=1, prompts=1, tiny=True, device="cpu", emit=lambda r: None,
                         compiled=True, steps=4, chains=4, cases=("update",))
    assert [r["case"] for r in rows] == ["update", "rollout flat", "rollout tree", "update compiled"]
    assert rows[3]["gflop_per_step"] == rows[0]["gflop_per_step"] > 0 and rows[3]["seconds"] > 0


def test_bench_gpu_auto_micro_batch_is_the_estimate_s_choice_for_the_family_preset():
    """--batch auto: each update case at the micro-batch train.micro_batch=auto picks for the family's shipped preset
    (on --tiny, for an 80 GB H100 at the tiny resolution), capped, with the estimate beside the measured peak."""
    from flowrl.gpu_bench import H100_BYTES, auto_batch, run_gpu_bench

    rows = run_gpu_bench(("qwen",), (32,), batch="auto", prompts=1, tiny=True, device="cpu", emit=lambda r: None,
                         compiled=False, steps=4, chains=4, cases=("update",), most_batch=64)
    chosen, why = auto_batch("qwen", 32, torch.device("cpu"), False, 64, H100_BYTES)
    # 20B parameters of bf16 weights leave room for a few inputs on an 80 GB card at 80% of its memory
    assert rows[0]["batch"] == chosen == int((0.8 * H100_BYTES / 2**30 - why["state_gib"]) // why["activations_per_input_gib"])
    assert rows[0]["estimate_mb"] == round((why["state_gib"] + chosen * why["activations_per_input_gib"]) * 1024, 1)
    assert why["state_gib"] + chosen * why["activations_per_input_gib"] <= 0.8 * H100_BYTES / 2**30


def test_the_bench_gpu_command_reaches_the_benchmark_with_its_options(monkeypatch, tmp_path):
    """`flowrl bench-gpu --tiny ...` parses its options and calls the benchmark with them (the benchmark itself is
    tested above); the peak left out is read from the device."""
    import flowrl.gpu_bench as gpu_bench
    from flowrl.cli import main

    seen = {}

    def fake(families, resolutions, batch, prompts, peak_tflops, **kwargs):
        seen.update(families=families, resolutions=resolutions, peak=peak_tflops, tiny=kwargs.get("tiny"))
        return []

    monkeypatch.setattr(gpu_bench, "run_gpu_bench", fake)
    assert main(["bench-gpu", "--tiny", "--families", "sd35m", "--resolutions", "32", "--out",
                 str(tmp_path / "b.json")]) == 0
    assert seen == {"families": ("sd35m",), "resolutions": (32,), "peak": None, "tiny": True}


def test_bench_profile_times_each_cpu_setting_against_the_configured_rollout():
    """`flowrl bench --profile`: the same rollout (plan, prompts, noise) under each setting; the configured one
    reproduces its own latents exactly, bf16 autocast moves them (seconds are printed, not asserted)."""
    from flowrl.bench import profile_rollout
    from flowrl.config import load_config

    cfg = load_config(None, ["train.prompts_per_iter=1", "algorithm.group_size=2", "sampler.num_steps=2",
                             "guard.enabled=false"])
    out = profile_rollout(cfg, rounds=1, compile_blocks=False)
    rows = {r["setting"].split(" (")[0]: r for r in out["settings"]}
    assert rows["as configured"]["max_abs_latent_change"] == 0.0 and rows["as configured"]["speed_vs_configured"] == 1
    assert rows["bf16 autocast"]["max_abs_latent_change"] > 1e-4
    assert all(r["seconds"] > 0 for r in out["settings"]) and out["plan"].startswith("roots=")
