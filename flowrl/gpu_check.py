"""``flowrl gpu-check`` (``make gpu-check``): the one prepared command for a GPU machine, in stages.

Each stage runs in its own process with its own time budget, so one that fails or hangs (a CUDA error, a
compilation that overruns) is recorded and the next one still runs. A stage writes each row as soon as it is
measured, so a stage that runs out of time still reports what it measured, and the report files are rewritten
after every stage. The stages' budgets, process start-up included, add up to 7 minutes on one H100 80 GB,
leaving room in a 10-minute call for a rerun of a stage. It writes ``gpu_check.json`` (every stage's
status, seconds, rows or error) and ``gpu_check.md`` (the same as tables) into ``--out``. ``--tiny`` runs the
same stages on a CPU with shrunken models (the test suite does).

Stages:
- ``bench-sd35m``, ``bench-flux1``, ``bench-flux2-klein``, ``bench-qwen-image``, ``bench-wan21-1.3b``,
  ``bench-wan21-14b``, ``bench-zimage``, ``bench-hunyuanvideo15``, ``bench-ltx2``: ``flowrl bench-gpu`` on the published architectures with random weights. Per family and
  resolution: the LoRA update step (r 32 on the attention projections, bf16 autocast, fused AdamW) without and
  with gradient checkpointing, each at the micro-batch ``train.micro_batch=auto`` picks for the family's preset
  (at most 16, 8 with checkpointing; two timed steps after a warm-up; ``estimate_mb`` is the memory model's
  prediction beside the measured peak), then a flat rollout
  (``chains`` independent chains per prompt) and a BranchGRPO tree with as many leaves, one prompt, ``steps``
  steps; every row with measured FLOPs, TFLOP/s and MFU (rollouts: the FLOP count of one transformer call times
  the evaluations). SD3.5-M at 512 and 1024 px (8 chains at 1024), FLUX.1-dev, FLUX.2 [klein] 4B and Qwen-Image
  at 512 px, Wan 2.1 1.3B and 14B at 256 px x 9 frames (8 chains for 14B), Z-Image (6B) at 512 px with 8 steps, HunyuanVideo 1.5 (8.3B) at 256 px x 9 frames (8 chains), LTX-2 (19B, its audio stream
  beside the video) at 256 px x 9 frames (8 chains);
- ``end-to-end-sd35m``: the shipped SD3.5-M Flow-GRPO preset (LoRA) trained for two iterations at real size, 512
  px, bf16, with random weights of every component of its pipeline and of its reward model
  (:mod:`flowrl.models.published`: the MMDiT-X transformer, the VAE, CLIP-L, bigG and T5-XXL, PickScore's CLIP
  ViT-H/14, each built on the GPU; nothing downloaded), 2 prompts x 4 images a round: per iteration the time split,
  the peak memory beside ``flowrl memory``'s estimate (which leaves out the encoders, the VAE and the reward model:
  their size is given beside it), and the first update's max |ratio - 1| and mean |log ratio|; the first iteration
  batches its update by ``train.micro_batch``, the second recomputes the rollout's calls
  (``train.update_composition=rollout``), so both modes' deviation and cost are in one run;
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

from .callbacks import Callback

STAGES = {  # name -> seconds allowed on one H100, process start-up included; 7 minutes in all. A bench stage's
    # budget is about 10% over its time predicted from the measured H100 rates (`flowrl gpu-check --plan`)
    "bench-sd35m": 38,
    "bench-flux1": 43,
    "bench-flux2-klein": 30,
    "bench-qwen-image": 44,
    "bench-wan21-1.3b": 22,
    "bench-wan21-14b": 40,
    "bench-zimage": 31,
    "bench-hunyuanvideo15": 38,
    "bench-ltx2": 26,
    "end-to-end-sd35m": 43,
    "fsdp-world1": 20,
    "gpu-tests": 25,
    "tiny-main-job": 20,
}
TINY_TIME_FACTOR = 8  # the CPU check exercises every stage's code, not a GPU's speed: a slow shared CPU gets 8x
# per benchmark stage: the family, and per resolution (rollout steps, chains per prompt)
BENCH = {"bench-sd35m": ("sd35m", {512: (10, 16), 1024: (10, 8)}),
         "bench-flux1": ("flux1", {512: (10, 16)}),
         "bench-flux2-klein": ("flux2k", {512: (10, 16)}),
         "bench-qwen-image": ("qwen", {512: (10, 16)}),
         "bench-wan21-1.3b": ("wan13", {256: (10, 16)}),
         "bench-wan21-14b": ("wan14", {256: (10, 8)}),
         "bench-zimage": ("zimage", {512: (8, 8)}),  # a tree of 16 leaves needs splits at steps 0, 3, 6, 9
         "bench-hunyuanvideo15": ("hv15", {256: (10, 8)}),
         "bench-ltx2": ("ltx2", {256: (10, 8)})}
ROWS = "rows.jsonl"  # a stage's rows, one JSON object per line, appended as each is measured


def _stage_command(name: str, tiny: bool, out: Path) -> list[str]:
    return [sys.executable, "-m", "flowrl", "gpu-check", "--stage", name, "--stage-out", str(out)] + \
        (["--tiny"] if tiny else [])


def _rows(folder: Path) -> list[dict]:
    """The rows a stage wrote before it ended (a line cut short by a kill is dropped)."""
    path = folder / ROWS
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


def run_check(out_dir: Path, tiny: bool, stages: list[str] | None = None, emit=print) -> dict:
    """Every stage in its own process group within its budget; gpu_check.json and gpu_check.md are rewritten after
    every stage, so a check killed at its limit keeps every finished stage. Returns the report."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    report = {"tiny": tiny, "device": _device_name(tiny), "stages": results}
    for name in stages or list(STAGES):
        budget = STAGES[name] * (TINY_TIME_FACTOR if tiny else 1)
        with tempfile.TemporaryDirectory() as tmp:
            target = Path(tmp) / "stage.json"
            start = time.perf_counter()
            status, stdout, stderr, code = _run_stage(_stage_command(name, tiny, target), budget)
            seconds = time.perf_counter() - start
            if status == "timeout":
                result = {"status": "timeout", "error": f"over {budget} s"}
            elif code == 0 and target.is_file():
                result = {"status": "ok", **json.loads(target.read_text())}
            else:
                tail = (stderr or stdout).strip().splitlines()[-12:]
                result = {"status": "failed", "returncode": code, "error": "\n".join(tail)}
            rows = _rows(Path(tmp))
            if rows and not result.get("rows"):  # what a stage measured before it failed or ran out of time
                result["rows"] = rows
        result["seconds"] = round(seconds, 1)
        result["budget_s"] = budget
        results[name] = result
        kept = f", {len(result['rows'])} rows kept" if result["status"] != "ok" and result.get("rows") else ""
        emit(f"gpu-check: {name}: {result['status']} in {result['seconds']} s{kept}")
        _write_report(out_dir, report)
    _write_report(out_dir, report)
    return report


def _write_report(out_dir: Path, report: dict) -> None:
    from .report import atomic_write_bytes

    atomic_write_bytes(out_dir / "gpu_check.json", json.dumps(report, indent=1).encode())
    atomic_write_bytes(out_dir / "gpu_check.md", markdown(report).encode())


def _run_stage(cmd: list[str], budget: float) -> tuple[str, str, str, int | None]:
    """Run a stage in its own process group; past its budget the whole group ends (a pytest it started, a
    compile worker), so nothing of it holds the device during the next stage. Returns (status, stdout, stderr,
    return code)."""
    import signal

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        out, err = proc.communicate(timeout=budget)
        return "done", out, err, proc.returncode
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=5)
                break
            except subprocess.TimeoutExpired:
                continue
        out, err = proc.communicate()
        return "timeout", out, err, proc.returncode
    finally:
        try:  # the stage ended; anything it left running in its group ends with it
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _device_name(tiny: bool) -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() and not tiny else "cpu"


def markdown(report: dict) -> str:
    lines = [f"# flowrl gpu-check on {report['device']}{' (--tiny)' if report['tiny'] else ''}", "",
             "| stage | status | seconds | budget | rows |", "|---|---|---|---|---|"]
    for name, r in report["stages"].items():
        lines.append(f"| {name} | {r['status']} | {r['seconds']} | {r['budget_s']} | {len(r.get('rows') or [])} |")
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
    """One stage, in this process: each row appended to ``rows.jsonl`` beside ``out`` as it is measured, and the
    result as JSON at ``out`` when the stage ends."""
    rows_path = out.parent / ROWS

    def emit(line: str) -> None:
        with rows_path.open("a") as fh:
            fh.write(line.strip() + "\n")

    if name in BENCH:
        result = _bench(*BENCH[name], tiny, emit)
    else:
        result = {"fsdp-world1": _fsdp, "gpu-tests": _gpu_tests, "tiny-main-job": _main_job,
                  "end-to-end-sd35m": _end_to_end}[name](tiny, emit)
    out.write_text(json.dumps(result))


# the largest update micro-batch a bench stage times, per case (the checkpointing case's steps are the slowest, so it
# stops at 8 edges to keep each stage within its budget); --tiny picks its batch with the same selection and the same
# bounds (the shrunken models at 32 px are cheap enough), so a selection defect shows on a CPU too
MOST_BATCH = {"update": 16, "update checkpointing": 8}


def _bench(family: str, sizes: dict[int, tuple[int, int]], tiny: bool, emit) -> dict:
    from .gpu_bench import run_gpu_bench

    if tiny:  # the shrunken model at 32 px, four steps, four chains
        sizes = {32: (4, 4)}
    rows = run_gpu_bench((family,), tuple(sizes), batch="auto", prompts=1, tiny=tiny, emit=emit, compiled=False,
                         steps={(family, px): st for px, (st, _) in sizes.items()},
                         chains={(family, px): ch for px, (_, ch) in sizes.items()},
                         cases=("update", "update checkpointing"), most_batch=MOST_BATCH)
    return {"rows": rows}


def _train(args: list[str], tiny: bool, callbacks=()) -> Path:
    from .config import load_config
    from .trainer import Trainer

    device = "cpu" if tiny else "cuda"
    tmp = Path(tempfile.mkdtemp(prefix="flowrl-gpu-check-"))
    cfg = load_config(args[0], [*args[1:], f"device={device}", f"log.output_dir={tmp}", "log.run_name=check",
                                "log.progress=false", "log.sample_every=0"])
    Trainer(cfg, callbacks=list(callbacks)).train()
    return tmp / "check"


class _EndToEndReport(Callback):
    """The end-to-end stage's callback: each iteration's row as it ends, then the rollout-composition update for
    the next iteration."""

    def __init__(self, emit, extra: dict):
        self.emit, self.extra = emit, extra

    def on_train_begin(self, trainer) -> None:
        adapter = trainer.adapter  # what the memory estimate leaves out: encoders, VAE and the reward models
        modules = [getattr(adapter.pipe, n, None) for n in (*adapter.text_encoder_names, "vae")]
        modules += [getattr(getattr(scorer, "clip", None), "model", None) for _, _, scorer in trainer.rewards.items]
        self.extra["encoders_vae_reward_mb"] = round(sum(
            p.numel() * p.element_size() for m in modules if m is not None for p in m.parameters()) / 2 ** 20, 1)
        self.extra["setup_s"] = round(time.perf_counter() - self.extra.pop("start"), 1)

    def on_iteration_end(self, trainer, it: int, row: dict) -> None:
        keep = ("seconds_rollout", "seconds_reward", "seconds_train", "nfe_rollout", "nfe_train",
                "ratio_max_abs_dev_first_update", "mean_abs_log_ratio_first_update", "peak_memory_mb",
                "mfu_rollout", "mfu_update", "reward_mean/total")
        mode = "rollout" if trainer.objective.same_composition else "micro_batch"
        self.emit(json.dumps({"iteration": it, "update_composition": mode, **self.extra,
                              **{k: round(row[k], 6) if isinstance(row.get(k), float) else row.get(k)
                                 for k in keep if k in row}}))
        trainer.objective.same_composition = True  # the next iteration recomputes the rollout's own calls


def _end_to_end(tiny: bool, emit) -> dict:
    """Two iterations of the SD3.5-M Flow-GRPO preset at real size with random weights (shrunk on --tiny)."""
    from .config import load_config
    from .memory import estimate

    start = time.perf_counter()
    config = ["configs/sd35m_flow_grpo.yaml", "train.iterations=2", "train.prompts_per_iter=2",
              "algorithm.group_size=4", "rewards[0].name=flowrl.rewards.pickscore:RandomPickScore",
              "log.eval=none", "data.sample_seeds=[0]", "sampler.eval_num_steps=4", "log.save_every=0",
              # the update's CFG halves in one call with gradient through both, as the rollout made them: the
              # rollout-composition iteration then recomputes the rollout's exact calls (both iterations alike)
              "train.cfg_unconditional_grad=true"]
    if tiny:  # the same pipeline classes shrunk, fp32 on the CPU
        config += ["model.pretrained=random-sd3.5-medium-shrunk", "model.resolution=64", "model.dtype=fp32",
                   "train.mixed_precision=no", "rewards[0].args={scale: flow_grpo, shrunk: true}"]
    else:
        config += ["model.pretrained=random-sd3.5-medium", "model.dtype=bf16", "train.mixed_precision=bf16",
                   "rewards[0].args={scale: flow_grpo}"]
    predicted = estimate(load_config(config[0], config[1:]), [1])["per_process_gib"][0]
    rows = []

    def keep(line: str) -> None:
        rows.append(json.loads(line))
        emit(line)

    _train(config, tiny, [_EndToEndReport(keep, {"estimate_mb": round(predicted["total"] * 1024, 1),
                                                 "start": start})])
    return {"rows": rows}


def _fsdp(tiny: bool, emit=None) -> dict:
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


def _gpu_tests(tiny: bool, emit=None) -> dict:
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


def _main_job(tiny: bool, emit=None) -> dict:
    run = _train(["configs/tiny_shapes_flow_grpo.yaml", f"train.iterations={1 if tiny else 10}",
                  "sampler.noise_device=device", "log.eval=none", "log.save_every=0"], tiny)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    keep = ("iteration", "reward_mean/total", "seconds_rollout", "seconds_train", "tflops_rollout", "tflops_update",
            "mfu_rollout", "mfu_update", "peak_memory_mb")
    return {"rows": [{k: (round(r[k], 4) if isinstance(r.get(k), float) else r.get(k)) for k in keep if k in r}
                     for r in rows]}


# the cards a plan can be made for: name -> (memory the card reports, bytes)
