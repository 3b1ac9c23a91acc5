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
    print(f"run directory: {trainer.run_dir}", file=sys.stderr)
    run_dir = trainer.train()
    rows = __import__("flowrl.report", fromlist=["read_metrics"]).read_metrics(run_dir / "metrics.jsonl")
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
        print(json.dumps(summary))
    return 0


def _checkpoint_and_config(args, default_config: Path | None = None):
    """(checkpoint folder or None, config): a run directory means its latest checkpoint, and the run's own
    config.yaml is used unless a config is given."""
    from .checkpoint import latest_checkpoint
    from .config import load_config

    if not args.checkpoint:
        return None, load_config(args.config or default_config, args.overrides)
    ckpt = Path(args.checkpoint)
    if (ckpt / "checkpoints").is_dir():
        ckpt = latest_checkpoint(ckpt)
    if ckpt is None or not (ckpt / "state.json").is_file():
        raise FlowRLError(f"--checkpoint {args.checkpoint}: not a flowrl checkpoint or run directory")
    return ckpt, load_config(args.config or ckpt.parent.parent / "config.yaml", args.overrides)


def _apply_lora_checkpoint(adapter, cfg, ckpt: Path, command: str) -> None:
    from .checkpoint import load_lora_into
    from .trainer import add_lora

    if not cfg.train.lora.enabled:
        raise FlowRLError(f"{command} --checkpoint supports LoRA checkpoints; load a full fine-tune with diffusers")
    add_lora(adapter.transformer, cfg.train.lora, adapter.lora_targets)
    load_lora_into(adapter.transformer, ckpt)


def cmd_sample(args) -> int:

    from .models import SD3Adapter
    from .report import save_grid, side_by_side
    from .trainer import resolve_device, sample_images, sigmas_for

    ckpt, cfg = _checkpoint_and_config(args)
    prompts = args.prompt or cfg.data.sample_prompts or cfg.data.prompts
    if not prompts:
        from .prompts import DEFAULT_TINY_PROMPTS

        prompts = DEFAULT_TINY_PROMPTS[:4]
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else cfg.data.sample_seeds
    device = resolve_device(cfg.device)
    adapter = SD3Adapter.from_config(cfg.model, device)
    shape = adapter.latent_shape(cfg.model.resolution)
    sigmas = sigmas_for(cfg, adapter, args.steps or cfg.sampler.eval_num_steps)
    neg = adapter.encode_prompts([cfg.sampler.negative_prompt]) if cfg.sampler.guidance_scale > 1 else None
    base = sample_images(adapter, prompts, seeds, sigmas, shape, cfg.sampler.guidance_scale, neg)
    images, title = base, "base model"
    if ckpt is not None:
        _apply_lora_checkpoint(adapter, cfg, ckpt, "sample")
        tuned = sample_images(adapter, prompts, seeds, sigmas, shape, cfg.sampler.guidance_scale, neg)
        images = side_by_side(base, tuned, len(seeds))  # each row: base seeds | fine-tuned seeds
        title = f"left {len(seeds)}: base | right {len(seeds)}: {ckpt.name}"
        seeds = seeds * 2
    out = Path(args.out)
    save_grid(images, len(seeds), out, row_labels=prompts, title=title)
    print(json.dumps({"grid": str(out), "prompts": len(prompts), "seeds": len(seeds)}))
    return 0


def cmd_compare(args) -> int:
    from .report import compare_runs

    for d in args.runs:
        if not Path(d).is_dir():
            raise FlowRLError(f"{d}: not a directory")
    png, csv_path, summary = compare_runs([Path(d) for d in args.runs], Path(args.out), args.x, args.metric,
                                          args.smoothing)
    print(json.dumps({"png": str(png), "csv": str(csv_path), "summary": summary}, indent=1))
    return 0


def cmd_bench(args) -> int:
    from .bench import compare_table, run_bench

    tokens = ([args.config] if args.config else []) + list(args.overrides)
    overrides = [t for t in tokens if "=" in t]
    configs = [t for t in tokens if "=" not in t] or [None]
    results = []
    for path in configs:
        res = run_bench(_load(path, overrides), repeats=args.repeats)
        res["config"] = path or "default"
        results.append(res)
    if len(results) == 1:
        print(json.dumps(results[0], indent=1))
        return 0
    print(json.dumps({"runs": results, "side_by_side": compare_table(results)}, indent=1))
    return 0


def cmd_eval(args) -> int:
    """Held-out shapes accuracy of the shipped model (no arguments) or of a run's LoRA checkpoint; with
    --prompts / --reward, the papers' reward table (mean and std per metric) on a prompt file, also as CSV."""
    from .evaluate import format_table, reward_table, shapes_accuracy
    from .report import write_csv
    from .models import SD3Adapter
    from .trainer import resolve_device, sigmas_for

    default = Path(__file__).resolve().parent.parent / "configs" / "tiny_shapes_flow_grpo.yaml"
    ckpt, cfg = _checkpoint_and_config(args, default)
    table_mode = bool(args.prompts or args.reward)
    if table_mode:  # everything that can fail on bad input before any sampling
        from .config import RewardSpec
        from .prompts import prompt_set, read_prompt_file
        from .rewards import build_reward_set

        if args.prompts:
            prompts, metadata = read_prompt_file(args.prompts)
            if not prompts:
                raise FlowRLError(f"--prompts {args.prompts}: the file holds no prompts")
        else:
            prompts = prompt_set(args.split)
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
    adapter = SD3Adapter.from_config(cfg.model, resolve_device(cfg.device))
    if ckpt is not None:
        _apply_lora_checkpoint(adapter, cfg, ckpt, "eval")
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else cfg.log.eval_seeds
    sig = sigmas_for(cfg, adapter, args.steps or cfg.sampler.eval_num_steps)
    g = cfg.sampler.guidance_scale if args.cfg is None else args.cfg
    neg = adapter.encode_prompts([cfg.sampler.negative_prompt]) if g > 1 else None
    info = {"model": cfg.model.pretrained, "checkpoint": str(ckpt) if ckpt else None, "steps": len(sig) - 1,
            "guidance_scale": g}
    if not table_mode:
        result = shapes_accuracy(adapter, sig, seeds, g, neg, split=args.split)
        result.update(info)
        print(json.dumps(result))
        return 0
    summary, samples = reward_table(adapter, prompts, metadata, seeds, sig, reward_set, g, neg,
                                    cfg.algorithm.max_batch, progress=cfg.log.progress)
    out = Path(args.csv)
    write_csv(out.with_name(out.stem + "_samples.csv"), samples)
    write_csv(out, summary)
    print(format_table(summary))
    print(json.dumps({**info, "prompts": len(prompts), "seeds": seeds, "csv": str(out),
                      "samples_csv": str(out.with_name(out.stem + "_samples.csv")),
                      "metrics": {r["metric"]: [round(r["mean"], 6), round(r["std"], 6)] for r in summary}}))
    return 0


def cmd_pretrain_tiny(args) -> int:
    from .pretrain import pretrain_tiny

    pretrain_tiny(args.work_dir, steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed,
                  save_every=args.save_every, grid_every=args.grid_every, export_dir=args.export_dir,
                  decay_from=args.decay_from, lr_final=args.lr_final)
    return 0


def cmd_pretrain_tiny_clip(args) -> int:
    from .tiny_clip import pretrain_tiny_clip

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
    serve(args.name, reward_args, args.host, args.port)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flowrl", description="GRPO fine-tuning of flow-matching models.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="fine-tune with a config file and key.sub=value overrides")
    t.add_argument("config", nargs="?", help="YAML config (defaults: the tiny model, JPEG reward)")
    t.add_argument("overrides", nargs="*", help="overrides such as train.lr=1e-4 algorithm.group_size=8")
    t.set_defaults(func=cmd_train)
    s = sub.add_parser("sample", help="grid of prompts x seeds from the base model, or base | checkpoint side by side")
    s.add_argument("config", nargs="?")
    s.add_argument("overrides", nargs="*")
    s.add_argument("--checkpoint", help="checkpoint folder or run directory (latest checkpoint)")
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
    c.add_argument("--smoothing", type=int, default=1)
    c.add_argument("--out", default="compare")
    c.set_defaults(func=cmd_compare)
    b = sub.add_parser("bench", help="time one iteration; rollout batched vs max_batch=1; several configs side by "
                       "side with ratios to the first (JSON)")
    b.add_argument("config", nargs="?", help="a config; more configs and key=value overrides may follow")
    b.add_argument("overrides", nargs="*", help="more configs (compared with the first) and overrides for all")
    b.add_argument("--repeats", type=int, default=1)
    b.set_defaults(func=cmd_bench)
    e = sub.add_parser("eval", help="held-out shapes accuracy (one JSON line), or with --prompts/--reward a reward table + CSV")
    e.add_argument("config", nargs="?")
    e.add_argument("overrides", nargs="*")
    e.add_argument("--checkpoint")
    e.add_argument("--split", default="shapes-heldout", choices=["shapes-heldout", "shapes-train"])
    e.add_argument("--seeds", help="comma-separated seeds (default log.eval_seeds)")
    e.add_argument("--steps", type=int)
    e.add_argument("--cfg", type=float, help="guidance scale (default sampler.guidance_scale)")
    e.add_argument("--prompts", help="prompt file (.txt one per line, or .jsonl with 'prompt' and metadata): "
                   "print the reward table instead of the shapes accuracy")
    e.add_argument("--reward", action="append", help="reward to score with (repeatable; default: the config's)")
    e.add_argument("--reward-args", action="append", help="JSON keyword arguments for the matching --reward")
    e.add_argument("--csv", default="eval.csv", help="summary CSV (per-image scores go to <name>_samples.csv)")
    e.set_defaults(func=cmd_eval)
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
    pt.set_defaults(func=cmd_pretrain_tiny)
    sr = sub.add_parser("serve-reward", help="serve a reward over HTTP (POST /score) for the `remote` reward")
    sr.add_argument("name", help="registered reward name or module:function")
    sr.add_argument("--args", help="the reward's keyword arguments as a JSON object")
    sr.add_argument("--host", default="127.0.0.1")
    sr.add_argument("--port", type=int, default=8765, help="0 picks a free port (printed on the first line)")
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
    args = build_parser().parse_args(argv)
    # a config path that looks like an override belongs to the overrides
    if getattr(args, "config", None) and "=" in args.config and not os.path.exists(args.config):
        args.overrides = [args.config] + list(args.overrides)
        args.config = None
    try:
        return args.func(args)
    except FlowRLError as exc:
        print(f"flowrl: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("flowrl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
