"""The ``flowrl`` command line: train, sample, compare, bench."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .errors import FlowRLError


def _load(config: str | None, overrides: list[str]):
    from .config import load_config

    return load_config(config, overrides)


def cmd_train(args) -> int:
    from .trainer import Trainer

    cfg = _load(args.config, args.overrides)
    name = Path(args.config).stem if args.config else "default"
    trainer = Trainer(cfg, config_name=name)
    if trainer.procs.is_main:
        print(f"run directory: {trainer.run_dir}" + (f" ({trainer.procs.world} processes)" if trainer.procs.distributed
                                                     else ""), file=sys.stderr)
    run_dir = trainer.train()
    if not trainer.procs.is_main:
        return 0
    from .report import read_metrics

    rows = read_metrics(run_dir / "metrics.jsonl")
    if rows:
        k = max(1, len(rows) // 5)
        first = sum(r["reward_mean/total"] for r in rows[:k]) / k
        last = sum(r["reward_mean/total"] for r in rows[-k:]) / k
        summary = {"run_dir": str(run_dir), "iterations": len(rows), f"reward_first{k}": round(first, 5),
                   f"reward_last{k}": round(last, 5), "reward_curve": str(run_dir / "reward_curve.png"),
                   "samples": str(run_dir / "samples")}
        if (run_dir / "eval.json").is_file():
            ev = json.loads((run_dir / "eval.json").read_text())
            summary["heldout_before"] = ev.get("before")
            summary["heldout_after"] = ev.get("after")
            summary["before_after"] = str(run_dir / "before_after.png")
        if (run_dir / "best.json").is_file():  # the held-out curve's best point, and an early stop's reason
            summary["best"] = json.loads((run_dir / "best.json").read_text())
        print(json.dumps(summary))
    return 0


def _checkpoint_and_config(args, default_config: Path | None = None):
    """(checkpoint folder or None, config): a run directory means the weights it ended with (checkpoints/best when
    log.keep_best restored them, else its latest checkpoint; or the one after ``--iteration``), and the run's own
    config.yaml is used unless a config is given."""
    from .checkpoint import find_checkpoint
    from .config import load_config

    if not args.checkpoint:
        if getattr(args, "iteration", None) is not None:
            raise FlowRLError("--iteration needs --checkpoint RUN_DIR")
        return None, load_config(args.config or default_config, args.overrides)
    ckpt = find_checkpoint(args.checkpoint, getattr(args, "iteration", None))
    return ckpt, load_config(args.config or ckpt.parent.parent / "config.yaml", args.overrides)


def _split_name(split: str, cfg) -> str:
    """--split heldout / train -> the prompt set of the config's domain (moving-shapes-* for the video model)."""
    if split.startswith(("shapes-", "moving-shapes-")):
        return split
    return f"moving-shapes-{split}" if cfg.log.eval == "moving-shapes" else f"shapes-{split}"


def _load_checkpoint_into(adapter, cfg, ckpt: Path) -> None:
    """A run's LoRA or full fine-tuning weights into the base model's adapter."""
    from .checkpoint import checkpoint_is_lora, load_full_into, load_lora_into
    from .policy import add_lora

    if checkpoint_is_lora(ckpt):
        add_lora(adapter.transformer, cfg.train.lora, adapter.lora_targets)
        load_lora_into(adapter.transformer, ckpt, cfg)
    else:
        load_full_into(adapter.transformer, ckpt, cfg)


def cmd_sample(args) -> int:
    from .models import load_adapter
    from .rundir import check_writable
    from .report import save_grid, side_by_side
    from .sampling import Sampler, resolve_device

    ckpt, cfg = _checkpoint_and_config(args)
    prompts = args.prompt or cfg.data.sample_prompts or cfg.data.prompts
    if not prompts and cfg.data.prompt_set != "none":
        from .prompts import prompt_set

        prompts = prompt_set(cfg.data.prompt_set)[:4]
    if not prompts:
        from .prompts import DEFAULT_TINY_PROMPTS

        prompts = DEFAULT_TINY_PROMPTS[:4]
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else cfg.data.sample_seeds
    out = Path(args.out)
    if out.exists() and not args.overwrite:
        raise FlowRLError(f"--out {out} exists; choose another path or pass --overwrite")
    check_writable(out, "--out")
    adapter = load_adapter(cfg.model, resolve_device(cfg.device))
    base = Sampler(cfg, adapter, num_steps=args.steps)(prompts, seeds)
    images, title = base, "base model"
    if ckpt is not None:
        _load_checkpoint_into(adapter, cfg, ckpt)
        tuned = Sampler(cfg, adapter, num_steps=args.steps)(prompts, seeds)
        images = side_by_side(base, tuned, len(seeds))  # each row: base seeds | fine-tuned seeds
        title = f"left {len(seeds)}: base | right {len(seeds)}: {ckpt.parent.parent.name}/{ckpt.name}"
        seeds = seeds * 2
    save_grid(images, len(seeds), out, row_labels=prompts, title=title)
    print(json.dumps({"grid": str(out), "prompts": len(prompts), "seeds": len(seeds),
                      "checkpoint": str(ckpt) if ckpt else None}))
    return 0


def cmd_compare(args) -> int:
    from .report import compare_runs

    for d in args.runs:
        if not Path(d).is_dir():
            raise FlowRLError(f"{d}: not a directory")
    png, csv_path, summary = compare_runs([Path(d) for d in args.runs], Path(args.out), args.x, args.metric,
                                          args.smoothing, band=args.band)
    print(json.dumps({"png": str(png), "csv": str(csv_path), "summary": summary}, indent=1))
    return 0


def cmd_rank(args) -> int:
    from .report import atomic_write_bytes, format_rank_table, rank_runs, write_csv

    for d in args.runs:
        if not Path(d).is_dir():
            raise FlowRLError(f"{d}: not a directory")
    table, baseline = rank_runs([Path(d) for d in args.runs], args.baseline)
    text = format_rank_table(table, baseline)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / "rank.md", (text + "\n").encode())
    write_csv(out / "rank.csv", [{**r, "seeds": " ".join(map(str, r["seeds"]))} for r in table], list(table[0]))
    print(text)
    return 0


def cmd_bench_gpu(args) -> int:
    from .gpu_bench import run_gpu_bench

    if not args.tiny and not torch_cuda_available():
        raise FlowRLError("bench-gpu: no CUDA device here; run it on a GPU machine, or add --tiny for the CPU check")
    rows = run_gpu_bench(tuple(args.families), tuple(args.resolutions), args.batch, args.prompts, args.peak_tflops,
                         tiny=args.tiny)
    if args.out:
        from .report import atomic_write_bytes

        atomic_write_bytes(Path(args.out), json.dumps(rows, indent=1).encode())
    return 0


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def cmd_bench(args) -> int:
    from .bench import compare_table, memory_growth, run_bench

    tokens = ([args.config] if args.config else []) + list(args.overrides)
    overrides = [t for t in tokens if "=" in t]
    configs = [t for t in tokens if "=" not in t] or [None]
    if args.memory:
        if len(configs) > 1:
            raise FlowRLError("--memory measures one config; give one")
        print(json.dumps({"config": configs[0] or "default", **memory_growth(_load(configs[0], overrides), args.memory)}))
        return 0
    results = []
    for path in configs:
        res = run_bench(_load(path, overrides), repeats=args.repeats)
        res["config"] = path or "default"
        results.append(res)
    from accelerate import PartialState

    if not PartialState().is_main_process:  # under accelerate launch the main process prints
        return 0
    if len(results) == 1:
        print(json.dumps(results[0], indent=1))
        return 0
    print(json.dumps({"runs": results, "side_by_side": compare_table(results)}, indent=1))
    return 0


def cmd_eval(args) -> int:
    """Held-out accuracy (shapes, or moving shapes for a config with log.eval: moving-shapes) of the shipped model
    (no arguments) or of a run's checkpoint; with
    --prompts / --reward, the papers' reward table (mean and std per metric) on a prompt file, also as CSV."""
    from .evaluate import format_table, reward_table
    from .models import load_adapter
    from .report import write_csv
    from .sampling import Sampler, resolve_device

    ckpt, cfg = _checkpoint_and_config(args, Path("tiny_shapes_flow_grpo.yaml"))
    table_mode = bool(args.prompts or args.reward)
    if table_mode:  # everything that can fail on bad input before any sampling
        from .rundir import check_writable

        check_writable(Path(args.csv), "--csv")
        from .config import RewardSpec
        from .prompts import prompt_set, read_prompt_file
        from .rewards import build_reward_set

        if args.prompts:
            prompts, metadata = read_prompt_file(args.prompts)
            if not prompts:
                raise FlowRLError(f"--prompts {args.prompts}: the file holds no prompts")
        else:
            prompts = prompt_set(_split_name(args.split, cfg))
            metadata = [{} for _ in prompts]
        try:
            reward_args = [json.loads(a) for a in (args.reward_args or [])]
        except json.JSONDecodeError as exc:
            raise FlowRLError(f"--reward-args must be JSON objects ({exc.msg})") from exc
        names = args.reward or []
        if len(reward_args) > len(names):
            raise FlowRLError("--reward-args: one per --reward, in the same order")
        specs = ([RewardSpec(name=n, args=reward_args[i] if i < len(reward_args) else {}) for i, n in enumerate(names)]
                 or cfg.rewards)
        reward_set = build_reward_set(specs)
    adapter = load_adapter(cfg.model, resolve_device(cfg.device))
    if ckpt is not None:
        _load_checkpoint_into(adapter, cfg, ckpt)
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else cfg.log.eval_seeds
    sampler = Sampler(cfg, adapter, num_steps=args.steps, guidance_scale=args.cfg)
    info = {"model": cfg.model.pretrained, "checkpoint": str(ckpt) if ckpt else None, "steps": len(sampler.sigmas) - 1,
            "guidance_scale": sampler.guidance_scale}
    if not table_mode:
        from .shapes.evaluate import moving_shapes_accuracy, shapes_accuracy

        accuracy = moving_shapes_accuracy if cfg.log.eval == "moving-shapes" else shapes_accuracy
        result = accuracy(sampler, seeds, split=_split_name(args.split, cfg))
        result.update(info)
        print(json.dumps(result))
        return 0
    summary, samples = reward_table(sampler, prompts, metadata, seeds, reward_set, cfg.sampler.max_batch,
                                    progress=cfg.log.progress)
    out = Path(args.csv)
    write_csv(out.with_name(out.stem + "_samples.csv"), samples)
    write_csv(out, summary)
    print(format_table(summary))
    print(json.dumps({**info, "prompts": len(prompts), "seeds": seeds, "csv": str(out),
                      "samples_csv": str(out.with_name(out.stem + "_samples.csv")),
                      "metrics": {r["metric"]: [round(r["mean"], 6), round(r["std"], 6)] for r in summary}}))
    return 0


def cmd_presets(args) -> int:
    """The shipped presets: each config's name and the command line its header starts with."""
    from .resources import configs_dir

    for path in sorted(configs_dir().glob("*.yaml")):
        first = path.read_text().splitlines()[0].lstrip("# ").strip() if path.stat().st_size else ""
        print(f"{path.stem:34s} {first}")
    return 0


def cmd_pretrain_tiny(args) -> int:
    from .shapes.pretrain import pretrain_tiny

    pretrain_tiny(args.work_dir, steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed,
                  save_every=args.save_every, grid_every=args.grid_every, export_dir=args.export_dir,
                  decay_from=args.decay_from, lr_final=args.lr_final, init_from=args.init_from,
                  eval_every=args.eval_every)
    return 0


def cmd_pretrain_tiny_video(args) -> int:
    from .shapes.pretrain_video import pretrain_tiny_video

    pretrain_tiny_video(args.work_dir, steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed,
                        save_every=args.save_every, eval_every=args.eval_every, export_dir=args.export_dir,
                        decay_from=args.decay_from, lr_final=args.lr_final, shift=args.shift,
                        init_from=args.init_from, motion_weight=args.motion_weight,
                        high_noise_expert=args.high_noise_expert, boundary=args.boundary,
                        patch_size=tuple(args.patch_size) if args.patch_size else None)
    return 0


def cmd_pretrain_tiny_clip(args) -> int:
    from .shapes.tiny_clip import pretrain_tiny_clip

    print(json.dumps(pretrain_tiny_clip(steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed,
                                        export_dir=args.export_dir)))
    return 0


def cmd_serve_reward(args) -> int:
    from .rewards.remote import serve

    try:
        reward_args = json.loads(args.args) if args.args else {}
    except json.JSONDecodeError as exc:
        raise FlowRLError(f"--args must be a JSON object such as '{{\"scale\": 26}}' ({exc.msg})") from exc
    if not isinstance(reward_args, dict):
        raise FlowRLError("--args must be a JSON object")
    serve(args.name, reward_args, args.host, args.port, max_body_mb=args.max_mb)
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _unit_interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"{value} must lie strictly between 0 and 1")
    return value


class _Parser(argparse.ArgumentParser):
    """Bad command-line arguments end in one line, like every other flowrl error."""

    def error(self, message):
        self.exit(2, f"flowrl: error: {self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="flowrl", description="GRPO fine-tuning of flow-matching models.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="fine-tune with a config file and key.sub=value overrides")
    t.add_argument("config", nargs="?", help="YAML config (defaults: the tiny model, JPEG reward)")
    t.add_argument("overrides", nargs="*", help="overrides such as train.lr=1e-4 algorithm.group_size=8")
    t.set_defaults(func=cmd_train)
    s = sub.add_parser("sample", help="grid of prompts x seeds from the base model, or base | checkpoint side by side")
    s.add_argument("config", nargs="?")
    s.add_argument("overrides", nargs="*")
    s.add_argument("--checkpoint", help="checkpoint folder or run directory (the weights it ended with: "
                   "checkpoints/best when the run restored them, else its latest; LoRA or full fine-tuning)")
    s.add_argument("--iteration", type=int, help="with a run directory: the checkpoint saved after this iteration")
    s.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    s.add_argument("--prompt", action="append", help="prompt (repeatable); default: the config's sample prompts")
    s.add_argument("--seeds", help="comma-separated seeds")
    s.add_argument("--steps", type=int, help="ODE steps (default sampler.eval_num_steps)")
    s.add_argument("--out", default="samples.png")
    s.set_defaults(func=cmd_sample)
    c = sub.add_parser("compare", help="reward or held-out curves of several runs (seed bands), PNG, CSV and a "
                         "summary: final values and what each run spent to reach the first run's final value")
    c.add_argument("runs", nargs="+", help="run directories")
    c.add_argument("--x", default="iteration", choices=["iteration", "nfe", "rollouts", "time"])
    c.add_argument("--metric", default="reward_mean/total",
                   help="a logged metric, or heldout/all / heldout/reward (the log.eval_every curve)")
    c.add_argument("--smoothing", type=_positive_int, default=1, help="moving-average window in points (>= 1)")
    c.add_argument("--out", default="compare")
    c.add_argument("--band", choices=["minmax", "se"], default="minmax",
                   help="seed band: min-max, or +-1 standard error of the mean")
    c.set_defaults(func=cmd_compare)
    rk = sub.add_parser("rank", help="ranked preset table from finished runs: held-out gain mean +- standard error "
                        "over seeds, reward, cleanliness, time, images; differences from a baseline beyond 2 SE")
    rk.add_argument("runs", nargs="+", help="run directories (runs differing only in train.seed form one preset)")
    rk.add_argument("--baseline", help="the preset label compared against (default: the first run's)")
    rk.add_argument("--out", default="rank", help="folder for rank.csv and rank.md")
    rk.set_defaults(func=cmd_rank)
    b = sub.add_parser("bench", help="time one iteration; rollout batched vs max_batch=1; several configs side by "
                       "side with ratios to the first (JSON)")
    b.add_argument("config", nargs="?", help="a config; more configs and key=value overrides may follow")
    b.add_argument("overrides", nargs="*", help="more configs (compared with the first) and overrides for all")
    b.add_argument("--repeats", type=int, default=1)
    b.add_argument("--memory", type=int, metavar="N", help="instead: train N iterations and print the resident "
                   "memory's slope over the second half (MiB per 100 iterations), to catch leaks")
    b.set_defaults(func=cmd_bench)
    bg = sub.add_parser("bench-gpu", help="SD3.5-Medium- and FLUX.1-sized transformers (random weights, real configs): "
                        "LoRA GRPO update step and flat / tree rollouts; time, images/s, TFLOP/s, MFU, peak memory")
    bg.add_argument("--families", nargs="+", default=["sd35m", "flux1"], choices=["sd35m", "flux1"])
    bg.add_argument("--resolutions", nargs="+", type=_positive_int, default=[512, 1024])
    bg.add_argument("--batch", type=_positive_int, default=4, help="edges per update step")
    bg.add_argument("--prompts", type=_positive_int, default=2, help="prompts per rollout (16 leaves each)")
    bg.add_argument("--peak-tflops", type=float, default=989.0, help="the device's dense bf16 peak (H100/H200 SXM: 989)")
    bg.add_argument("--tiny", action="store_true", help="shrunken models at 64 px: the same code path on a CPU")
    bg.add_argument("--out", help="also write the rows to this JSON file")
    bg.set_defaults(func=cmd_bench_gpu)
    e = sub.add_parser("eval", help="held-out shapes accuracy (one JSON line), or with --prompts/--reward a reward table + CSV")
    e.add_argument("config", nargs="?")
    e.add_argument("overrides", nargs="*")
    e.add_argument("--checkpoint", help="checkpoint folder or run directory (LoRA or full fine-tuning)")
    e.add_argument("--iteration", type=int, help="with a run directory: the checkpoint saved after this iteration")
    e.add_argument("--split", default="heldout", choices=["heldout", "train", "shapes-heldout", "shapes-train",
                                                          "moving-shapes-heldout", "moving-shapes-train"],
                   help="held-out or training captions of the config's domain (log.eval: shapes or moving-shapes)")
    e.add_argument("--seeds", help="comma-separated seeds (default log.eval_seeds)")
    e.add_argument("--steps", type=int)
    e.add_argument("--cfg", type=float, help="guidance scale (default sampler.guidance_scale)")
    e.add_argument("--prompts", help="prompt file (.txt one per line, or .jsonl with 'prompt' and metadata): "
                   "print the reward table instead of the shapes accuracy")
    e.add_argument("--reward", action="append", help="reward to score with (repeatable; default: the config's)")
    e.add_argument("--reward-args", action="append", help="JSON keyword arguments for the matching --reward")
    e.add_argument("--csv", default="eval.csv", help="summary CSV (per-image scores go to <name>_samples.csv)")
    e.set_defaults(func=cmd_eval)
    ps = sub.add_parser("presets", help="list the shipped configs (usable by name from any folder)")
    ps.set_defaults(func=cmd_presets)
    pt = sub.add_parser("pretrain-tiny", help="pretrain the embedded tiny model on the shapes domain (CPU, resumable)")
    pt.add_argument("--work-dir", default="runs/pretrain-tiny", help="state, grids; rerun to resume")
    pt.add_argument("--steps", type=int, default=4000)
    pt.add_argument("--batch", type=int, default=32)
    pt.add_argument("--lr", type=float, default=1e-3)
    pt.add_argument("--seed", type=int, default=0)
    pt.add_argument("--save-every", type=int, default=250)
    pt.add_argument("--grid-every", type=int, default=500)
    pt.add_argument("--export-dir", default=None, help="default: assets/tiny_shapes")
    pt.add_argument("--decay-from", type=int, default=None,
                    help="step at which a cosine learning-rate decay starts (ends at --steps); default constant")
    pt.add_argument("--lr-final", type=float, default=0.1, help="final learning rate as a fraction of --lr")
    pt.add_argument("--init-from", default=None,
                    help="an exported tiny shapes model folder (e.g. assets/tiny_shapes) to continue pretraining: its "
                         "weights start the run and the EMA, with a fresh optimizer; the export records it")
    pt.add_argument("--eval-every", type=int, default=0,
                    help="held-out accuracy of the EMA weights (24 captions x 4 seeds) every that many steps, "
                         "printed and kept in <work-dir>/progress.jsonl; 0 = none")
    pt.set_defaults(func=cmd_pretrain_tiny)
    pv = sub.add_parser("pretrain-tiny-video", help="pretrain the embedded tiny video model on the moving-shapes "
                        "domain (CPU, resumable)")
    pv.add_argument("--work-dir", default="runs/pretrain-tiny-video", help="state, grids, progress; rerun to resume")
    pv.add_argument("--steps", type=int, default=6000)
    pv.add_argument("--batch", type=int, default=32)
    pv.add_argument("--lr", type=float, default=1e-3)
    pv.add_argument("--seed", type=int, default=0)
    pv.add_argument("--save-every", type=int, default=250)
    pv.add_argument("--eval-every", type=int, default=1000, help="held-out readout and video grid every N steps")
    pv.add_argument("--export-dir", default=None, help="default: assets/tiny_moving_shapes")
    pv.add_argument("--decay-from", type=int, default=None,
                    help="step at which a cosine learning-rate decay starts (ends at --steps); default constant")
    pv.add_argument("--lr-final", type=float, default=0.1, help="final learning rate as a fraction of --lr")
    pv.add_argument("--shift", type=float, default=1.0, help="time shift of the training sigmas and the exported "
                    "scheduler (3 puts more training at high noise, where the layout is decided)")
    pv.add_argument("--init-from", help="warm start: the transformer of an earlier run's state folder "
                    "(<work-dir>/state) or exported model folder; its text encoder too when the shapes match")
    pv.add_argument("--motion-weight", type=float, default=0.0,
                    help="extra weight on the frame-to-frame differences of the flow-matching target")
    pv.add_argument("--patch-size", type=_positive_int, nargs=3, metavar=("T", "H", "W"),
                    help="the transformer's patch (default 1 4 4); 4 4 4 puts the four frames in every token")
    pv.add_argument("--high-noise-expert", help="an exported model folder: train a Wan 2.2-style low-noise expert "
                    "for it (sigmas below --boundary, its text encoder frozen) and export the two-expert model")
    pv.add_argument("--boundary", type=_unit_interval, default=0.875, help="the two experts' boundary in sigma (Wan "
                    "2.2 text-to-video: 0.875)")
    pv.set_defaults(func=cmd_pretrain_tiny_video)
    sr = sub.add_parser("serve-reward", help="serve a reward over HTTP (POST /score) for the `remote` reward")
    sr.add_argument("name", help="registered reward name or module:function")
    sr.add_argument("--args", help="the reward's keyword arguments as a JSON object")
    sr.add_argument("--host", default="127.0.0.1")
    sr.add_argument("--port", type=int, default=8765, help="0 picks a free port (printed on the first line)")
    sr.add_argument("--max-mb", type=float, default=64.0, help="largest request body accepted, in MiB")
    sr.set_defaults(func=cmd_serve_reward)

    pc = sub.add_parser("pretrain-tiny-clip", help="train the tiny shapes CLIP (open_clip architecture) on the CPU")
    pc.add_argument("--steps", type=int, default=1500)
    pc.add_argument("--batch", type=int, default=64)
    pc.add_argument("--lr", type=float, default=1e-3)
    pc.add_argument("--seed", type=int, default=0)
    pc.add_argument("--export-dir", default=None, help="default: assets/tiny_clip")
    pc.set_defaults(func=cmd_pretrain_tiny_clip)
    return p


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, or a bad argument already reported in one line
        return exc.code if isinstance(exc.code, int) else 2
    # a config path that looks like an override belongs to the overrides
    if getattr(args, "config", None) and "=" in args.config and not os.path.exists(args.config):
        args.overrides = [args.config] + list(args.overrides)
        args.config = None
    try:
        return args.func(args)
    except FlowRLError as exc:
        kind = "stopped" if getattr(exc, "exit_code", 2) != 2 else "error"
        print(f"flowrl: {kind}: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 2)
    except KeyboardInterrupt:
        print("flowrl: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:  # a disk that fills up or a folder that disappears mid-run: one line, not a traceback
        where = f" {exc.filename}" if exc.filename else ""
        print(f"flowrl: error: cannot write or read{where}: {exc.strerror or exc}; free space or choose another "
              "location (files written before this are complete: flowrl writes to a temporary name, then renames)",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
