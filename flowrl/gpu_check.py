"""``flowrl gpu-check`` (``make gpu-check``): the one prepared command for a GPU machine, in stages.

Each stage runs in its own process with its own time budget, so one that fails or hangs (a cuBLAS error, a
compilation that overruns) is recorded and the next one still runs. The whole check is sized for 8 minutes on one
H200. It writes ``gpu_check.json`` (every stage's status, seconds, rows or error) and ``gpu_check.md`` (the same
as tables) into ``--out``. ``--tiny`` runs the same stages on a CPU with shrunken models (the test suite does).

Stages:
- ``bench-sd35m``, ``bench-flux1``, ``bench-flux2-klein``, ``bench-qwen-image``, ``bench-wan21-1.3b``,
  ``bench-wan21-14b``: ``flowrl bench-gpu``'s LoRA update step (fused / unfused AdamW, gradient checkpointing) and
  flat / tree rollouts on the published architectures (random weights; SD3.5-M and FLUX.1 at 512 and 1024 px,
  FLUX.2 [klein] 4B and Qwen-Image at 512, Wan 2.1 1.3B and 14B at 256 px x 9 frames), with measured FLOPs and MFU;
- ``fsdp-world1``: a short sharded run (``train.fsdp.enabled=true``) of the tiny model on the device, its peak
  memory beside ``flowrl memory``'s estimate for the same config;
- ``gpu-tests``: the GPU-marked tests (``pytest -m gpu``);
- ``tiny-main-job``: a few iterations of the shipped main job with noise drawn on the device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STAGES = {  # name -> seconds allowed on the GPU (the tiny CPU check shares them); 8 minutes in all
    "bench-sd35m": 75,
    "bench-flux1": 75,
    "bench-flux2-klein": 55,
    "bench-qwen-image": 70,
    "bench-wan21-1.3b": 50,
    "bench-wan21-14b": 55,
    "fsdp-world1": 40,
    "gpu-tests": 30,
    "tiny-main-job": 30,
}
# per benchmark stage: the family's layout, its resolutions and the prompts of its rollouts (16 chains each)
# Wan 2.1 14B at 256 px x 9 frames: its frames reduced so that one GPU holds the update and the 16-chain rollout
BENCH = {"bench-sd35m": ("sd35m", (512, 1024), 2), "bench-flux1": ("flux1", (512, 1024), 2),
         "bench-flux2-klein": ("flux2k", (512,), 1), "bench-qwen-image": ("qwen", (512,), 1),
         "bench-wan21-1.3b": ("wan13", (256,), 1), "bench-wan21-14b": ("wan14", (256,), 1)}


def _stage_command(name: str, tiny: bool, out: Path) -> list[str]:
    return [sys.executable, "-m", "flowrl", "gpu-check", "--stage", name, "--stage-out", str(out)] + \
        (["--tiny"] if tiny else [])


def run_check(out_dir: Path, tiny: bool, stages: list[str] | None = None, emit=print) -> dict:
    """Every stage in its own process within its budget; returns and writes the results."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in stages or list(STAGES):
        # the CPU check exercises every stage's code, not the GPU's speed: a shared CPU gets four times the time
        budget = STAGES[name] * (4 if tiny else 1)
        with tempfile.TemporaryDirectory() as tmp:
            target = Path(tmp) / "stage.json"
            start = time.perf_counter()
            try:
                done = subprocess.run(_stage_command(name, tiny, target), capture_output=True, text=True,
                                      timeout=budget, env={**os.environ, "PYTHONUNBUFFERED": "1"})
                seconds = time.perf_counter() - start
                if done.returncode == 0 and target.is_file():
                    result = {"status": "ok", **json.loads(target.read_text())}
                else:
                    tail = (done.stderr or done.stdout).strip().splitlines()[-12:]
                    result = {"status": "failed", "returncode": done.returncode, "error": "\n".join(tail)}
            except subprocess.TimeoutExpired:
                seconds, result = time.perf_counter() - start, {"status": "timeout", "error": f"over {budget} s"}
        result["seconds"] = round(seconds, 1)
        result["budget_s"] = budget
        results[name] = result
        emit(f"gpu-check: {name}: {result['status']} in {result['seconds']} s")
    report = {"tiny": tiny, "device": _device_name(tiny), "stages": results}
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=1))
    (out_dir / "gpu_check.md").write_text(markdown(report))
    return report


def _device_name(tiny: bool) -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() and not tiny else "cpu"


def markdown(report: dict) -> str:
    lines = [f"# flowrl gpu-check on {report['device']}{' (--tiny)' if report['tiny'] else ''}", "",
             "| stage | status | seconds | budget |", "|---|---|---|---|"]
    for name, r in report["stages"].items():
        lines.append(f"| {name} | {r['status']} | {r['seconds']} | {r['budget_s']} |")
    for name, r in report["stages"].items():
        rows = r.get("rows")
        if rows:
            cols = list(dict.fromkeys(k for row in rows for k in row))
            lines += ["", f"## {name}", "", "| " + " | ".join(cols) + " |", "|---" * len(cols) + "|"]
            lines += ["| " + " | ".join(str(row.get(c, "")) for c in cols) + " |" for row in rows]
        if r.get("error"):
            lines += ["", f"## {name}: {r['status']}", "", "```", r["error"], "```"]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ the stages
def run_stage(name: str, tiny: bool, out: Path) -> None:
    """One stage, in this process; its result as JSON at ``out``."""
    if name in BENCH:
        result = _bench(*BENCH[name], tiny)
    else:
        result = {"fsdp-world1": _fsdp, "gpu-tests": _gpu_tests, "tiny-main-job": _main_job}[name](tiny)
    out.write_text(json.dumps(result))


def _bench(family: str, resolutions: tuple[int, ...], prompts: int, tiny: bool) -> dict:
    from .gpu_bench import run_gpu_bench

    rows = run_gpu_bench((family,), (32,) * len(resolutions) if tiny else resolutions, prompts=prompts, tiny=tiny,
                         emit=lambda line: None, compiled=False)
    return {"rows": rows}


def _train(args: list[str], tiny: bool) -> Path:
    from .config import load_config
    from .trainer import Trainer

    device = "cpu" if tiny else "cuda"
    tmp = Path(tempfile.mkdtemp(prefix="flowrl-gpu-check-"))
    cfg = load_config(args[0], [*args[1:], f"device={device}", f"log.output_dir={tmp}", "log.run_name=check",
                                "log.progress=false", "log.sample_every=0"])
    Trainer(cfg).train()
    return tmp / "check"


def _fsdp(tiny: bool) -> dict:
    from .config import load_config
    from .memory import estimate

    config = ["configs/tiny_flow_grpo.yaml", f"train.iterations={1 if tiny else 3}", "train.fsdp.enabled=true",
              "train.prompts_per_iter=2"]
    run = _train(config, tiny)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    predicted = estimate(load_config(config[0], config[1:]), [1])["per_process_gib"][0]
    last = rows[-1]
    return {"rows": [{"peak_memory_mb": round(last["peak_memory_mb"], 1),
                      "estimate_total_mb": round(predicted["total"] * 1024, 1),
                      "weights_mb": round(last["memory/weights_mb"], 3),
                      "estimate_weights_mb": round(predicted["weights"] * 1024, 3),
                      "iterations": len(rows), "sharded_checkpoint": (run / "checkpoints").is_dir()}]}


def _gpu_tests(tiny: bool) -> dict:
    import torch

    if tiny or not torch.cuda.is_available():
        return {"rows": [{"skipped": "no CUDA device: the GPU-marked tests need one"}]}
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", str(root / "tests")],
                          capture_output=True, text=True, cwd=root)
    last = (done.stdout.strip().splitlines() or [""])[-1]
    if done.returncode not in (0, 5):  # 5: nothing collected
        raise RuntimeError(done.stdout[-3000:])
    return {"rows": [{"pytest": last}]}


def _main_job(tiny: bool) -> dict:
    run = _train(["configs/tiny_shapes_flow_grpo.yaml", f"train.iterations={1 if tiny else 10}",
                  "sampler.noise_device=device", "log.eval=none", "log.save_every=0"], tiny)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    keep = ("iteration", "reward_mean/total", "seconds_rollout", "seconds_train", "tflops_rollout", "tflops_update",
            "mfu_rollout", "mfu_update", "peak_memory_mb")
    return {"rows": [{k: (round(r[k], 4) if isinstance(r.get(k), float) else r.get(k)) for k in keep if k in r}
                     for r in rows]}
