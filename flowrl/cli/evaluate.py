"""``flowrl eval``: the held-out evaluation, the reward table on prompts or a dataset, and runs compared."""

from __future__ import annotations

import json
from pathlib import Path

from ..cli_types import positive_int
from ..errors import FlowRLError
from .common import (ALLOW_PLUGINS_HELP, DEFAULT_PRESET, checkpoint_and_config, config_evaluator, finite_json,
                     load_run_config, parse_seeds, split_name)


def cmd_eval(args) -> int:
    """The config's held-out evaluation (log.eval; one JSON line) of the shipped model (no arguments: the main
    job's preset) or of a run's checkpoint; with
    --prompts / --reward, the papers' reward table (mean and std per metric) on a prompt file, also as CSV."""
    from ..editing import prepend_sources
    from ..evaluate import format_table, group_means, per_prompt_means, reward_table
    from ..models import load_adapter
    from ..policy import load_trained_weights
    from ..report import atomic_write_bytes, save_grid, write_csv
    from ..sampling import Sampler, resolve_device

    if args.compare:
        return _eval_compare(args)
    ckpt, cfg = checkpoint_and_config(args, Path(DEFAULT_PRESET))
    table_mode = bool(args.prompts or args.reward or args.dataset)
    if table_mode:  # everything that can fail on bad input before any sampling
        prompts, metadata, reward_set = _table_inputs(args, cfg)
    seeds = parse_seeds(args.seeds) if args.seeds else cfg.log.eval_seeds
    evaluator = None if table_mode else config_evaluator(cfg)
    adapter = load_adapter(cfg.model, resolve_device(cfg.device))
    if ckpt is not None:
        load_trained_weights(adapter, cfg, ckpt)
    sampler = Sampler(cfg, adapter, num_steps=args.steps, guidance_scale=args.cfg)
    info = {"model": cfg.model.pretrained, "checkpoint": str(ckpt) if ckpt else None, "steps": len(sampler.sigmas) - 1,
            "guidance_scale": sampler.guidance_scale}
    if not table_mode:
        result = evaluator(sampler, seeds, split=args.split)
        result.update(info)
        print(json.dumps(finite_json(result), allow_nan=False))
        return 0
    grid_prompts = min(len(prompts), 8)
    summary, samples, images = reward_table(sampler, prompts, metadata, seeds, reward_set, cfg.sampler.max_batch,
                                            progress=cfg.log.progress, keep_images=grid_prompts)
    out = Path(args.csv)
    write_csv(out.with_name(out.stem + "_samples.csv"), samples)
    write_csv(out.with_name(out.stem + "_prompts.csv"), per_prompt_means(samples, [r["metric"] for r in summary]))
    write_csv(out, summary)
    grid = out.with_name(out.stem + "_grid.png")  # videos: frame strips, and a GIF and an MP4 beside it
    shown = prepend_sources(images, prompts[:grid_prompts], len(seeds))  # edit requests: the source first
    save_grid(shown, shown.shape[0] // grid_prompts, grid, row_labels=prompts[:grid_prompts])
    print(format_table(summary))
    report = {**info, "prompts": len(prompts), "seeds": seeds, "csv": str(out),
              "samples_csv": str(out.with_name(out.stem + "_samples.csv")),
              "prompts_csv": str(out.with_name(out.stem + "_prompts.csv")), "grid": str(grid),
              "grid_rows": prompts[:grid_prompts],
              "metrics": {r["metric"]: {"mean": r["mean"], "std": r["std"], "n": r["n"], "invalid": r["invalid"]}
                          for r in summary}}
    if args.group_by:  # a benchmark's own aggregate: the mean per task, and the overall mean of the task means
        report["groups"] = group_means(samples, prompts, metadata, args.group_by, [r["metric"] for r in summary])
    report = finite_json(report)
    atomic_write_bytes(out.with_suffix(".json"), (json.dumps(report, indent=1, allow_nan=False) + "\n").encode())
    print(json.dumps({**report, "summary": str(out.with_suffix(".json"))}, allow_nan=False))
    return 0


def _table_inputs(args, cfg):
    """The reward table's prompts, metadata and rewards from --dataset / --prompts / the evaluator's split (else the
    config's own prompts) and --reward (else the config's rewards); bad input fails here, before any model loads."""
    from ..config import RewardSpec
    from ..prompts import prompt_set, read_prompt_file
    from ..rewards import build_reward_set
    from ..rundir import check_writable

    if args.csv is None:
        import time

        args.csv = f"eval-{time.strftime('%Y%m%d-%H%M%S')}.csv"
    out = Path(args.csv)
    if out.is_dir():
        raise FlowRLError(f"--csv {out} is a folder; give a file name such as {out / 'eval.csv'}")
    outputs = [out, out.with_suffix(".json"), out.with_name(out.stem + "_grid.png")] + (
        [] if args.compare else [out.with_name(out.stem + "_samples.csv"), out.with_name(out.stem + "_prompts.csv")])
    existing = next((o for o in outputs if o.exists()), None)
    if existing is not None:
        raise FlowRLError(f"--csv {out}: {existing} exists; choose a new name (an evaluation never replaces files)")
    check_writable(out.parent, "--csv")
    if args.dataset:
        from ..prompts import read_dataset

        prompts, metadata = read_dataset(args.dataset, args.dataset_split, args.prompt_column)
        if args.limit:
            prompts, metadata = prompts[:args.limit], metadata[:args.limit]
    elif args.prompts:
        prompts, metadata = read_prompt_file(args.prompts)
        if not prompts:
            raise FlowRLError(f"--prompts {args.prompts}: the file holds no prompts")
    elif cfg.log.eval != "none":
        prompts = prompt_set(split_name(args.split, cfg))
        metadata = [{} for _ in prompts]
    else:  # no evaluator to name a held-out set: the config's own prompts
        from ..prompts import PromptSource

        source = PromptSource.from_config(cfg.data, cfg.train.seed, cfg.model)
        prompts, metadata = source.prompts, source.metadata
    try:
        reward_args = [json.loads(a) for a in (args.reward_args or [])]
    except json.JSONDecodeError as exc:
        raise FlowRLError(f"--reward-args must be JSON objects ({exc.msg})") from exc
    names = args.reward or []
    if len(reward_args) > len(names):
        raise FlowRLError("--reward-args: one per --reward, in the same order")
    specs = ([RewardSpec(name=n, args=reward_args[i] if i < len(reward_args) else {}) for i, n in enumerate(names)]
             or cfg.rewards)
    if getattr(args, "group_by", None):
        missing = next((k for k, m in enumerate(metadata) if m.get(args.group_by) is None), None)
        if missing is not None:
            columns = sorted({c for m in metadata for c, v in m.items() if v is not None})
            raise FlowRLError(f"--group-by {args.group_by}: prompt {missing} ({prompts[missing][:60]!r}) has no such "
                              f"metadata column (the columns: {', '.join(columns) or 'none'})")
    reward_set = build_reward_set(specs)
    reward_set.check_metadata(prompts, metadata, "--dataset" if args.dataset else "prompts")
    return prompts, metadata, reward_set


def _eval_compare(args) -> int:
    """``flowrl eval --compare A B ...``: the same prompts, seeds and rewards on each run's weights (or ``base``, the
    first run's starting model), side by side: per metric each one's mean, and each one's paired difference from
    the first with its standard error; a CSV, a JSON summary and one grid with a column block per run."""
    import torch

    from ..checkpoint import find_checkpoint, lora_rank
    from ..evaluate import format_table, reward_table
    from ..models import load_adapter
    from ..policy import load_trained_weights
    from ..report import atomic_write_bytes, save_grid, write_csv
    from ..sampling import Sampler, resolve_device

    if len(args.compare) < 2:
        raise FlowRLError("--compare needs two or more runs (a run directory, a checkpoint folder, or base)")
    if args.checkpoint:
        raise FlowRLError("--compare names the runs itself; leave out --checkpoint")
    entries = []  # (label, checkpoint or None, config)
    first = next((c for c in args.compare if c != "base"), None)
    if first is None:
        raise FlowRLError("--compare: name at least one run besides base")
    base_ckpt = find_checkpoint(first, None)
    for name in args.compare:
        ckpt = None if name == "base" else find_checkpoint(name, None)
        source = ckpt or base_ckpt
        cfg = load_run_config(args, source)
        label = "base" if ckpt is None else Path(name).name
        rank = lora_rank(ckpt) if ckpt is not None else None
        if rank is not None and rank != cfg.train.lora.rank:  # known from the file's header: before any sampling
            raise FlowRLError(f"--compare: {name} holds LoRA weights of rank {rank} and its config says "
                              f"train.lora.rank={cfg.train.lora.rank}; leave out CONFIG so that each run uses its own, "
                              f"or compare runs of one rank")
        entries.append((label, ckpt, cfg))
    prompts, metadata, reward_set = _table_inputs(args, entries[0][2])
    seeds = parse_seeds(args.seeds) if args.seeds else entries[0][2].log.eval_seeds
    grid_prompts = min(len(prompts), 8)
    per_run = []
    for label, ckpt, cfg in entries:
        adapter = load_adapter(cfg.model, resolve_device(cfg.device))
        if ckpt is not None:
            load_trained_weights(adapter, cfg, ckpt)
        sampler = Sampler(cfg, adapter, num_steps=args.steps, guidance_scale=args.cfg)
        summary, samples, images = reward_table(sampler, prompts, metadata, seeds, reward_set,
                                                cfg.sampler.max_batch, progress=cfg.log.progress,
                                                keep_images=grid_prompts)
        print(f"{label}:\n{format_table(summary)}")
        per_run.append((label, summary, samples, images))
    metrics = [r["metric"] for r in per_run[0][1]]
    rows = []
    for m in metrics:
        row = {"metric": m}
        first_scores = torch.tensor([s[m] for s in per_run[0][2]], dtype=torch.float64)
        for label, summary, samples, _ in per_run:
            scores = torch.tensor([s[m] for s in samples], dtype=torch.float64)
            row[f"{label} mean"] = next(r["mean"] for r in summary if r["metric"] == m)
            if label != per_run[0][0]:
                diff = scores - first_scores  # paired: the same prompt and seed
                diff = diff[torch.isfinite(diff)]
                row[f"{label} - {per_run[0][0]}"] = float(diff.mean()) if diff.numel() else float("nan")
                row[f"{label} - {per_run[0][0]} se"] = (float(diff.std() / diff.numel() ** 0.5) if diff.numel() > 1
                                                        else float("nan"))
        rows.append(row)
    out = Path(args.csv)
    write_csv(out, rows)
    runs, s = len(per_run), len(seeds)
    blocks = [images.view(grid_prompts, s, *images.shape[1:]) for _, _, _, images in per_run]
    grid = out.with_name(out.stem + "_grid.png")  # one row per prompt: each run's seeds side by side
    save_grid(torch.cat(blocks, dim=1).reshape(grid_prompts * runs * s, *images.shape[1:]), runs * s, grid,
              row_labels=prompts[:grid_prompts], title=" | ".join(label for label, *_ in per_run))
    report = finite_json({"runs": [label for label, *_ in per_run], "prompts": len(prompts), "seeds": seeds,
                          "csv": str(out), "grid": str(grid), "metrics": rows})
    atomic_write_bytes(out.with_suffix(".json"), (json.dumps(report, indent=1, allow_nan=False) + "\n").encode())
    print(json.dumps({**report, "summary": str(out.with_suffix(".json"))}, allow_nan=False))
    return 0


def add_parsers(sub) -> None:
    """This group's subcommands on the ``flowrl`` parser's ``sub``."""
    e = sub.add_parser("eval", help="the config's held-out evaluation (log.eval; one JSON line), or with --prompts/--reward a "
                       "reward table + CSV")
    e.add_argument("config", nargs="?")
    e.add_argument("overrides", nargs="*")
    e.add_argument("--checkpoint", help="checkpoint folder or run directory (LoRA or full fine-tuning)")
    e.add_argument("--allow-plugins", action="store_true", help=ALLOW_PLUGINS_HELP)
    e.add_argument("--iteration", type=int, help="with a run directory: the checkpoint saved after this iteration")
    e.add_argument("--split", default="heldout",
                   help="heldout or train: the captions the config's evaluator (log.eval) holds out or trains on; or "
                        "a prompt set by name")
    e.add_argument("--seeds", help="comma-separated seeds and ranges, 0,1,2 or 16-31 (default log.eval_seeds)")
    e.add_argument("--steps", type=int, help="ODE steps (default sampler.eval_num_steps)")
    e.add_argument("--cfg", type=float, help="guidance scale (default sampler.guidance_scale)")
    e.add_argument("--prompts", help="prompt file (.txt one per line, or .jsonl with 'prompt' and metadata; an editing "
                   "model's rows give their 'source' image): print the reward table instead of the held-out evaluation")
    e.add_argument("--dataset", help="a Hugging Face dataset of prompts (local file or folder, or hub id): print the "
                   "reward table over it")
    e.add_argument("--dataset-split", default="train", help="--dataset: the split to read")
    e.add_argument("--prompt-column", default="prompt", help="--dataset: the column holding the prompts")
    e.add_argument("--limit", type=positive_int, help="--dataset: only its first N prompts")
    e.add_argument("--compare", nargs="+", metavar="RUN", help="two or more run directories, checkpoint folders or "
                   "base (the first run's starting model): the reward table of each on the same prompts and seeds, "
                   "side by side, with paired differences from the first")
    e.add_argument("--group-by", metavar="COLUMN", help="also report each metric's mean per value of this metadata "
                   "column (GenEval's per-task scores) and the mean of those means (its overall score)")
    e.add_argument("--reward", action="append", help="reward to score with (repeatable; default: the config's)")
    e.add_argument("--reward-args", action="append", help="JSON keyword arguments for the matching --reward")
    e.add_argument("--csv", default=None, help="summary CSV (default eval-<time>.csv; an existing file is never "
                   "replaced); per-image scores go to <name>_samples.csv, the summary as JSON to <name>.json, a grid of "
                   "the first 8 prompts x seeds to <name>_grid.png")
    e.set_defaults(func=cmd_eval)
