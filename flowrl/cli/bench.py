"""Timing: ``flowrl bench`` (CPU or GPU iterations), ``bench-gpu`` (real-size layouts) and ``gpu-check``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..cli_types import batch_size, positive_int, positive_number, power_of_two
from ..errors import FlowRLError
from .common import load_cli_config, torch_cuda_available


def cmd_gpu_check(args) -> int:
    from ..gpu_check import STAGES, run_check, run_stage

    if args.stage:  # one stage, in the process run_check started for it
        run_stage(args.stage, args.tiny, Path(args.stage_out))
        return 0
    if args.plan:  # a dry run on the CPU: every case's micro-batch and predicted peak for the named card
        from ..gpu_plan import plan_check

        plan = plan_check(args.card, args.tiny, args.only, emit=lambda line: print(line, file=sys.stderr))
        print(json.dumps(plan, indent=1))
        if plan["problems"]:
            raise FlowRLError(f"gpu-check --plan: {plan['problems'][0]}" + (
                f" (and {len(plan['problems']) - 1} more)" if len(plan["problems"]) > 1 else ""))
        return 0
    if not args.tiny and not torch_cuda_available():
        raise FlowRLError("gpu-check: no CUDA device here; run it on a GPU machine, or add --tiny for the CPU check")
    unknown = [s for s in args.only or [] if s not in STAGES]
    if unknown:
        raise FlowRLError(f"gpu-check --only: unknown stage {unknown[0]!r}; stages: {', '.join(STAGES)}")
    out = Path(args.out)
    if (out / "gpu_check.json").exists():
        raise FlowRLError(f"--out {out} already holds a gpu_check.json; choose another folder")
    report = run_check(out, args.tiny, args.only, emit=lambda line: print(line, file=sys.stderr))
    print(json.dumps({"out": str(out), **{n: r["status"] for n, r in report["stages"].items()}}))
    return 0 if all(r["status"] == "ok" for r in report["stages"].values()) else 1


def cmd_bench(args) -> int:
    from ..bench import alternate, compare_table, memory_growth, run_bench

    tokens = ([args.config] if args.config else []) + list(args.overrides)
    overrides = [t for t in tokens if "=" in t]
    configs = [t for t in tokens if "=" not in t] or [None]
    if args.profile:
        from ..bench import profile_rollout

        if len(configs) > 1:
            raise FlowRLError("--profile measures one config; give one")
        result = profile_rollout(load_cli_config(configs[0], overrides), args.rounds)
        for row in result["settings"]:
            print(f"{row['setting']:48s} {row['seconds']:8.3f} s  x{row['speed_vs_configured']:.2f}  "
                  f"max |change| of the final latents {row['max_abs_latent_change']:.1e}", file=sys.stderr)
        print(json.dumps({"config": configs[0] or "default", **result}, indent=1))
        return 0
    if args.memory:
        if len(configs) > 1:
            raise FlowRLError("--memory measures one config; give one")
        growth = memory_growth(load_cli_config(configs[0], overrides), args.memory)
        print(json.dumps({"config": configs[0] or "default", **growth}))
        return 0
    results = []
    for path in configs:
        res = run_bench(load_cli_config(path, overrides), repeats=args.repeats)
        res["config"] = path or "default"
        results.append(res)
    from accelerate import PartialState

    if not PartialState().is_main_process:  # under accelerate launch the main process prints
        return 0
    if len(results) == 1:
        print(json.dumps(results[0], indent=1))
        return 0
    # the side-by-side ratios from configs timed in turns (A B C A B C ...), medians and spread
    names = [r["config"] for r in results]
    if len(set(names)) < len(names):  # the same config twice (a noise check): number them
        names = [f"{i + 1}. {n}" for i, n in enumerate(names)]
    alternated = alternate([load_cli_config(path, overrides) for path in configs], names, args.rounds)
    print(json.dumps({"runs": results, "side_by_side": compare_table(results), "alternated": alternated}, indent=1))
    return 0


def cmd_bench_gpu(args) -> int:
    from ..gpu_bench import run_gpu_bench

    if not args.tiny and not torch_cuda_available():
        raise FlowRLError("bench-gpu: no CUDA device here; run it on a GPU machine, or add --tiny for the CPU check")
    rows = run_gpu_bench(tuple(args.families), tuple(args.resolutions), args.batch, args.prompts, args.peak_tflops,
                         tiny=args.tiny, steps=args.steps, chains=args.chains,
                         attention_backend=args.attention_backend)
    if args.out:
        from ..report import atomic_write_bytes

        atomic_write_bytes(Path(args.out), json.dumps(rows, indent=1).encode())
    return 0


def add_parsers(sub) -> None:
    """This group's subcommands on the ``flowrl`` parser's ``sub``."""
    gc = sub.add_parser("gpu-check", help="the prepared GPU check: benchmark, sharded run, GPU tests and the main job, "
                        "each stage in its own process and time budget; JSON and Markdown into --out")
    gc.add_argument("--tiny", action="store_true", help="the same stages on a CPU with tiny models")
    gc.add_argument("--out", default="gpu_check", help="folder for gpu_check.json and gpu_check.md (a new one)")
    gc.add_argument("--only", nargs="+", metavar="STAGE", help="run only these stages")
    gc.add_argument("--plan", action="store_true", help="a dry run on the CPU: every benchmark case's micro-batch and "
                    "predicted peak memory on --card (the real run's batch selection), every rollout plan built, each "
                    "stage's seconds predicted from the measured H100 rates against its budget, the budgets summed; fails in one line naming a case that would not fit")
    gc.add_argument("--card", default="H100 80GB", choices=["H100 80GB", "H200", "A100 80GB", "A100 40GB"],
                    help="the card --plan sizes for")
    gc.add_argument("--stage", help=argparse.SUPPRESS)
    gc.add_argument("--stage-out", help=argparse.SUPPRESS)
    gc.set_defaults(func=cmd_gpu_check)
    b = sub.add_parser("bench", help="time one iteration; rollout batched vs max_batch=1; several configs side by "
                       "side with ratios to the first (JSON)")
    b.add_argument("config", nargs="?", help="a config; more configs and key=value overrides may follow")
    b.add_argument("overrides", nargs="*", help="more configs (compared with the first) and overrides for all")
    b.add_argument("--repeats", type=int, default=1, help="rollout timings per config (the best is kept)")
    b.add_argument("--rounds", type=positive_int, default=3, help="several configs: measured iterations per config, "
                   "taken in turns (A B C A B C ...); medians and spread")
    b.add_argument("--memory", type=int, metavar="N", help="instead: train N iterations and print the resident "
                   "memory's slope over the second half (MiB per 100 iterations), to catch leaks")
    b.add_argument("--profile", action="store_true", help="instead: the config's rollout under each CPU setting "
                   "(threads, fp32 matmul precision, bf16 autocast, SDPA kernels, compiled blocks), --rounds times in "
                   "turns: seconds, speed against the configured run and how far each moves the final latents")
    b.set_defaults(func=cmd_bench)
    bg = sub.add_parser("bench-gpu", help="SD3.5-Medium- and FLUX.1-sized transformers (random weights, real configs): "
                        "LoRA GRPO update step and flat / tree rollouts; time, images/s, TFLOP/s, MFU, peak memory")
    bg.add_argument("--families", nargs="+", default=["sd35m", "flux1"], choices=["sd35m", "flux1", "flux2k", "qwen", "wan13", "wan14", "zimage", "hv15", "ltx2"],
                    help="architectures to build (SD3.5-M, FLUX.1-dev, FLUX.2 [klein] 4B, Qwen-Image, Wan 2.1 1.3B / 14B, "
                         "Z-Image 6B, HunyuanVideo 1.5 8.3B, LTX-2 19B)")
    bg.add_argument("--resolutions", nargs="+", type=positive_int, default=[512, 1024], help="image sides in pixels")
    bg.add_argument("--batch", type=batch_size, default=4, help="edges per update step, or auto: the micro-batch "
                    "train.micro_batch=auto picks for the family's preset on this device")
    bg.add_argument("--prompts", type=positive_int, default=2, help="prompts per rollout")
    bg.add_argument("--steps", type=positive_int, default=20, help="denoising steps per rollout")
    bg.add_argument("--chains", type=power_of_two, default=16, help="leaves per prompt: flat chains, or the tree's "
                    "leaves (branch 2 at steps 0, 3, 6, ...)")
    bg.add_argument("--attention-backend", default="native", choices=["native", "native_cudnn"],
                    help="the SDPA kernels (train.attention_backend)")
    bg.add_argument("--peak-tflops", type=positive_number, default=None, help="the device's dense bf16 peak in "
                    "TFLOP/s (default: read from its name: H100 SXM 989, PCIe 756, NVL 835, H200 989, A100 312)")
    bg.add_argument("--tiny", action="store_true", help="shrunken models at 64 px: the same code path on a CPU")
    bg.add_argument("--out", help="also write the rows to this JSON file")
    bg.set_defaults(func=cmd_bench_gpu)
