"""Throughput and MFU in every run's metrics: the FLOPs counted once per input shape equal the FLOP counter's
count of one call times the calls made, and the rates are those FLOPs over the logged seconds."""

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from flowrl.config import load_config
from flowrl.throughput import device_peak_tflops


def test_throughput_fields_are_the_counted_flops_over_the_logged_seconds(tmp_path):
    from flowrl.trainer import Trainer

    cfg = load_config("configs/tiny_flow_grpo.yaml", ["train.iterations=2", "train.prompts_per_iter=2",
                                                      f"log.output_dir={tmp_path}", "log.run_name=t", "log.sample_every=0",
                                                      "log.save_every=0", "log.progress=false", "train.peak_tflops=0.5"])
    trainer = Trainer(cfg)
    # one call of the transformer to be trained (LoRA included) on one sample, under the FLOP counter, outside the
    # meter (which counts only inside a phase)
    adapter = trainer.adapter
    x = torch.randn(1, *adapter.latent_shape(cfg.model.resolution))
    cond = adapter.encode_prompts([trainer.prompts.prompts[0]])
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        adapter.velocity(x, torch.full((1,), 0.5), cond)
    per_sample = counter.get_total_flops()
    per_step = executed_flops(adapter, x, cond)  # forward + backward, as they execute (LoRA: no base weight grads)
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "t/metrics.jsonl").read_text().splitlines()]
    assert per_sample > 0
    for r in rows:
        assert r["flops_rollout"] == r["nfe_rollout"] * per_sample  # forwards only
        assert r["flops_update"] == pytest.approx(r["nfe_train"] * per_step, rel=0.05)
        for phase, seconds in (("rollout", r["seconds_rollout"]), ("update", r["seconds_train"])):
            assert r[f"tflops_{phase}"] == pytest.approx(r[f"flops_{phase}"] / seconds / 1e12, rel=1e-12)
            assert r[f"mfu_{phase}"] == pytest.approx(r[f"tflops_{phase}"] / 0.5, rel=1e-12)
            assert r[f"images_per_second_per_process_{phase}"] == pytest.approx(r["leaves"] / seconds, rel=1e-12)


def executed_flops(adapter, x, cond) -> float:
    """What one forward and its backward execute, counted by FlopCounterMode around both."""
    with FlopCounterMode(display=False) as counter:
        adapter.velocity(x, torch.full((x.shape[0],), 0.5), cond).float().pow(2).mean().backward()
    adapter.transformer.zero_grad(set_to_none=True)
    return counter.get_total_flops()


@pytest.mark.parametrize("lora", [True, False])
def test_the_meter_counts_what_a_training_step_executes(tmp_path, lora):
    """The meter's forward + backward of one training call against FlopCounterMode over both, on the tiny SD3: LoRA
    (frozen base weights get no gradient, about 2x the forward) and full fine-tuning (about 3x)."""
    from flowrl.throughput import FlopMeter
    from flowrl.trainer import Trainer

    cfg = load_config("configs/tiny_flow_grpo.yaml", [f"train.lora.enabled={str(lora).lower()}",
                                                      f"log.output_dir={tmp_path}", "log.run_name=t", "log.progress=false"])
    trainer = Trainer(cfg)
    adapter = trainer.adapter
    x = torch.randn(2, *adapter.latent_shape(cfg.model.resolution))
    cond = adapter.encode_prompts(trainer.prompts.prompts[:2])
    truth = executed_flops(adapter, x, cond)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        adapter.velocity(x, torch.full((2,), 0.5), cond)
    forward = counter.get_total_flops()
    meter = FlopMeter([adapter.transformer])
    with meter.phase("update"):
        adapter.velocity(x, torch.full((2,), 0.5), cond)  # the first call of the shape: counted under the counter
        adapter.velocity(x, torch.full((2,), 0.5), cond)  # the cached count
    counted = meter.take()["update"] / 2
    assert counted == pytest.approx(truth, rel=0.05)
    assert counted / forward == pytest.approx(2.0 if lora else 3.0, abs=0.15)
    print(f"lora={lora}: meter {counted:.4g}, FlopCounterMode {truth:.4g}, ratio to forward {counted / forward:.3f}")


def test_peak_tflops_from_the_config_or_the_device_table():
    assert device_peak_tflops(torch.device("cpu"), None) is None  # no MFU on a CPU unless told the peak
    assert device_peak_tflops(torch.device("cpu"), 2.5) == 2.5


@pytest.mark.slow  # about 20 s: six measured iterations (make test-slow)
def test_bench_side_by_side_alternates_the_configs_and_reports_medians_spread_and_outside_shares(capsys):
    """`flowrl bench A B` on the tiny FLUX and tiny Wan presets: per config the share of each phase outside the
    transformer; the configs timed in turns over three rounds, with medians, spread and ratio ranges (printed,
    not asserted as times)."""
    from flowrl.cli import main

    a, b = "configs/tiny_flux_branch_grpo.yaml", "configs/tiny_video_default.yaml"
    assert main(["bench", a, b, "train.prompts_per_iter=1", "log.eval=none", "--rounds", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    for run in out["runs"]:
        for phase in ("rollout", "update"):
            assert 0 <= run[f"outside_transformer_share_{phase}"] <= 1
    alt = out["alternated"]
    assert alt["order"] == [a, b] * 3  # A B A B A B: a change of load lands on both
    for name in (a, b):
        for part in ("iteration", "rollout", "update", "outside_rollout", "outside_update"):
            s = alt["per_config"][name][part]
            assert s["min"] <= s["median"] <= s["max"] and s["spread"] >= 0
        for phase, r in alt["ratios_vs_first"][name].items():
            assert r["low"] <= r["ratio"] <= r["high"] and isinstance(r["reliable"], bool)
    assert all(r["ratio"] == 1.0 for r in alt["ratios_vs_first"][a].values())


@pytest.mark.heavy
def test_gpu_check_tiny_runs_every_stage_on_a_cpu(tmp_path):
    """`flowrl gpu-check --tiny`: every stage in its own process within its budget, one JSON and one Markdown
    table; a second check never writes over the first."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "flowrl", "gpu-check", "--tiny", "--out", str(tmp_path / "check")]
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "check/gpu_check.json").read_text())
    assert list(report["stages"]) == ["bench-sd35m", "bench-flux1", "bench-flux2-klein", "bench-qwen-image",
                                      "bench-wan21-1.3b", "bench-wan21-14b", "bench-zimage", "bench-hunyuanvideo15", "bench-ltx2",
                                      "end-to-end-sd35m",
                                      "fsdp-world1", "gpu-tests", "tiny-main-job"]
    for name, stage in report["stages"].items():
        assert stage["status"] == "ok", (name, stage.get("error"))
        assert 0 < stage["seconds"] <= stage["budget_s"]
    bench = report["stages"]["bench-flux1"]["rows"]
    assert {r["case"] for r in bench} >= {"update", "rollout flat", "rollout tree"}
    for row in bench:  # rollouts and updates alike: the measured FLOPs over the measured time
        assert row["achieved_tflops"] >= 0 and "mfu" in row
    assert {r["case"] for r in bench} == {"update", "update checkpointing", "rollout flat", "rollout tree"}
    # the SD3.5-M preset end to end on the shrunk pipeline: two iterations, the second recomputing the rollout's calls
    e2e = report["stages"]["end-to-end-sd35m"]["rows"]
    assert [(r["iteration"], r["update_composition"]) for r in e2e] == [(0, "micro_batch"), (1, "rollout")]
    for r in e2e:
        assert r["ratio_max_abs_dev_first_update"] < 1e-5 and r["nfe_rollout"] == 2 * 4 * 10  # fp32 on the CPU
        assert r["estimate_mb"] > 0 and r["encoders_vae_reward_mb"] > 0 and r["setup_s"] > 0
        assert r["seconds_rollout"] > 0 and r["seconds_train"] > 0
    assert e2e[1]["nfe_train"] >= e2e[0]["nfe_train"]  # whole calls are recomputed
    fsdp = report["stages"]["fsdp-world1"]["rows"][0]
    assert fsdp["sharded_checkpoint"] and fsdp["weights_mb"] == pytest.approx(fsdp["estimate_weights_mb"], rel=1e-2)
    table = (tmp_path / "check/gpu_check.md").read_text()
    assert "| bench-flux1 | ok |" in table and "## tiny-main-job" in table
    again = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=120)
    assert again.returncode != 0 and "already holds a gpu_check.json" in again.stderr


@pytest.mark.heavy
def test_auto_micro_batch_is_chosen_once_and_kept_on_resume(tmp_path):
    """train.micro_batch=auto: the largest micro-batch that flowrl memory's estimate fits, written to the run folder
    and logged; a resume takes the folder's value (even where the machine would now choose another)."""
    from flowrl.memory import auto_micro_batch
    from flowrl.trainer import Trainer

    common = ["train.prompts_per_iter=2", f"log.output_dir={tmp_path}", "log.run_name=auto", "log.sample_every=0",
              "log.progress=false", "train.micro_batch=auto"]
    Trainer(load_config("configs/tiny_flow_grpo.yaml", [*common, "train.iterations=1"])).train()
    saved = json.loads((tmp_path / "auto/micro_batch.json").read_text())
    cfg = load_config("configs/tiny_flow_grpo.yaml", common)
    expected, _ = auto_micro_batch(cfg, torch.device("cpu"), 1)
    assert saved["micro_batch"] == expected >= 1
    first = json.loads((tmp_path / "auto/metrics.jsonl").read_text().splitlines()[0])
    assert first["micro_batch"] == expected
    # the folder's choice wins on resume: make it differ from what the estimate gives now
    (tmp_path / "auto/micro_batch.json").write_text(json.dumps({**saved, "micro_batch": 3}))
    Trainer(load_config("configs/tiny_flow_grpo.yaml", [*common, "train.iterations=2", "resume=latest"])).train()
    rows = [json.loads(line) for line in (tmp_path / "auto/metrics.jsonl").read_text().splitlines()]
    assert [r["micro_batch"] for r in rows] == [expected, 3]


def test_a_stage_that_runs_out_of_time_keeps_the_rows_it_wrote(tmp_path, monkeypatch):
    """A stage appends each row to rows.jsonl as it is measured; one killed at its budget reports those rows (a
    line cut short by the kill is dropped), and the table shows them."""
    import sys

    from flowrl import gpu_check

    script = ("import json, pathlib, sys, time\n"
              "rows = pathlib.Path(sys.argv[1]).parent / 'rows.jsonl'\n"
              "for case in ('update', 'rollout flat'):\n"
              "    with rows.open('a') as fh: fh.write(json.dumps({'case': case, 'seconds': 1.5}) + '\\n')\n"
              "with rows.open('a') as fh: fh.write('{\"case\": \"rollout tr')\n"
              "time.sleep(60)\n")
    monkeypatch.setitem(gpu_check.STAGES, "bench-flux1", 3)
    monkeypatch.setattr(gpu_check, "_stage_command", lambda name, tiny, out: [sys.executable, "-c", script, str(out)])
    lines = []
    report = gpu_check.run_check(tmp_path / "check", tiny=False, stages=["bench-flux1"], emit=lines.append)
    stage = report["stages"]["bench-flux1"]
    assert stage["status"] == "timeout" and 3 <= stage["seconds"] < 30
    assert stage["rows"] == [{"case": "update", "seconds": 1.5}, {"case": "rollout flat", "seconds": 1.5}]
    assert lines == [f"gpu-check: bench-flux1: timeout in {stage['seconds']} s, 2 rows kept"]
    table = (tmp_path / "check/gpu_check.md").read_text()
    assert "| bench-flux1 | timeout | " in table and "| rollout flat | 1.5 |" in table


@pytest.mark.heavy
def test_gpu_check_plan_sizes_every_case_for_an_h100_and_names_one_that_does_not_fit(capsys, monkeypatch):
    """`flowrl gpu-check --plan --tiny` (about 2 minutes on two cores): the real run's batch selection for every benchmark case on the tiny models
    against an 80 GB card, every rollout plan built, the budgets summed within 7 minutes; a tree that cannot be built
    and a card too small are named in one line."""
    from flowrl import gpu_check, gpu_plan
    from flowrl.cli import main

    assert main(["gpu-check", "--plan", "--tiny"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["problems"] == [] and plan["budget_total_s"] <= 420
    assert {r["stage"] for r in plan["cases"]} == {s for s in gpu_check.STAGES if s in gpu_check.BENCH}
    assert all(r["share"] <= 0.9 and r["batch"] >= 1 for r in plan["cases"])
    monkeypatch.setitem(gpu_check.BENCH, "bench-zimage", ("zimage", {512: (8, 16)}))  # main 7d7dfac's zimage tree
    problems = gpu_plan.plan_check("H100 80GB", tiny=True, stages=["bench-zimage"], emit=lambda line: None)["problems"]
    assert any("bench-zimage: the tree rollout at 512 px: a tree of 16 leaves" in p for p in problems)
    monkeypatch.setitem(gpu_plan.CARDS, "H100 80GB", 2 ** 20)  # a 1 MiB card: nothing fits
    assert main(["gpu-check", "--plan", "--tiny", "--only", "bench-sd35m"]) == 2
    assert "gpu-check --plan: bench-sd35m: update at 32 px: train.micro_batch=auto: not even one input fits" in \
        capsys.readouterr().err


@pytest.mark.heavy
def test_gpu_check_plan_at_real_size_fits_an_h100(capsys):
    """The real-size plan (every family's published architecture, measured on replicas on the CPU; about 3 minutes
    on two cores): every case within 90% of an 80 GB card, every stage's predicted time within its budget."""
    from flowrl.cli import main

    assert main(["gpu-check", "--plan"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["problems"] == [] and max(r["share"] for r in plan["cases"]) <= 0.9
    # every benchmark stage's time, predicted from the measured H100 rates, within its budget; the budgets in 7 min
    assert len(plan["predicted_s"]) == 9 and plan["budget_total_s"] <= 420
    assert all(0 < seconds <= plan["budgets"][stage] for stage, seconds in plan["predicted_s"].items())
