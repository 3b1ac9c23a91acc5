"""The ``flowrl`` command line: train, sample, compare, bench."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .cli_types import Parser, batch_size, port, positive_int, positive_number, power_of_two
from .registry import COMMANDS
from .errors import ConfigError, FlowRLError


def _load(config: str | None, overrides: list[str]):
    from .config import load_config

    return load_config(config, overrides)


def cmd_train(args) -> int:
    from .trainer import Trainer

    cfg = _load(args.config, args.overrides)
    name = Path(args.config).stem if args.config else "default"
    trainer = Trainer(cfg, config_name=name)
    if trainer.procs.is_main:
        print(f"run directory: {trainer.run_dir}" + (f" ({trainer.procs.processes} processes)" if trainer.procs.distributed
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


def parse_seeds(text: str, flag: str = "--seeds") -> list[int]:
    """``0,1,2`` -> [0, 1, 2]; ``16-31`` -> 16, 17, ..., 31 (ranges and single seeds may mix: ``0,4-6``); anything
    else is one line naming the part that is not a seed or a range."""
    seeds = []
    for part in (p.strip() for p in text.split(",")):
        first, dash, last = part.partition("-")
        if part.isdigit():
            seeds.append(int(part))
        elif dash and first.isdigit() and last.isdigit() and int(first) <= int(last):
            if int(last) - int(first) >= 100_000:
                raise FlowRLError(f"{flag} {text}: the range {part} holds over 100,000 seeds; give a shorter one")
            seeds += range(int(first), int(last) + 1)
        else:
            raise FlowRLError(f"{flag} {text}: {part!r} is neither a seed nor a range; give seeds such as 0,1,2,3 or "
                              "16-31")
    from .config import check_seeds

    check_seeds(seeds, flag)
    return seeds


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


DEFAULT_PRESET = "tiny_shapes_flow_grpo.yaml"  # what `flowrl eval` evaluates with no config: the shipped model


def _evaluator(cfg):
    """The config's held-out evaluator (log.eval), or one line saying to choose one."""
    from .registry import EVALUATORS

    if cfg.log.eval == "none":
        raise FlowRLError("flowrl eval: the config has no held-out evaluator; give a config with log.eval set, or "
                          "--prompts / --reward for a reward table")
    return EVALUATORS.resolve(cfg.log.eval)()


def _split_name(split: str, cfg) -> str:
    """--split heldout / train -> the prompt set the config's evaluator names for it (or a prompt set by name)."""
    return getattr(_evaluator(cfg), "splits", {}).get(split, split) if cfg.log.eval != "none" else split


def cmd_sample(args) -> int:
    from .models import load_adapter
    from .policy import load_trained_weights
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
    seeds = parse_seeds(args.seeds) if args.seeds else cfg.data.sample_seeds
    out = Path(args.out)
    if out.exists() and not args.overwrite:
        raise FlowRLError(f"--out {out} exists; choose another path or pass --overwrite")
    check_writable(out, "--out")
    adapter = load_adapter(cfg.model, resolve_device(cfg.device))
    base = Sampler(cfg, adapter, num_steps=args.steps)(prompts, seeds)
    images, title = base, "base model"
    if ckpt is not None:
        load_trained_weights(adapter, cfg, ckpt)
        tuned = Sampler(cfg, adapter, num_steps=args.steps)(prompts, seeds)
        images = side_by_side(base, tuned, len(seeds))  # each row: base seeds | fine-tuned seeds
        title = f"left {len(seeds)}: base | right {len(seeds)}: {ckpt.parent.parent.name}/{ckpt.name}"
    columns = len(seeds) * (2 if ckpt is not None else 1)  # with a checkpoint: the base's seeds, then the tuned's
    save_grid(images, columns, out, row_labels=prompts, title=title)
    print(json.dumps({"grid": str(out), "prompts": len(prompts), "seeds": seeds, "columns": columns,
                      "checkpoint": str(ckpt) if ckpt else None}))
    return 0


def cmd_export(args) -> int:
    """A checkpoint as diffusers files: the LoRA file ``load_lora_weights`` reads, or (full fine-tuning) the
    consolidated transformer folder ``from_pretrained`` reads; sharded checkpoints are gathered into one copy."""
    import shutil

    from .checkpoint import checkpoint_is_lora, lora_metadata, lora_state_dict
    from .models import load_adapter
    from .policy import load_trained_weights
    from .rundir import check_writable

    args.config, args.overrides = None, []
    ckpt, cfg = _checkpoint_and_config(args)
    out = Path(args.out)
    if out.exists():
        raise FlowRLError(f"--out {out} exists; choose a new folder (an export never replaces files)")
    check_writable(out, "--out")
    adapter = load_adapter(cfg.model, "cpu")
    load_trained_weights(adapter, cfg, ckpt)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    transformer = adapter.transformer
    try:
        if checkpoint_is_lora(ckpt):
            adapter.save_lora(tmp, lora_state_dict(transformer), lora_metadata(transformer))
        else:
            transformer.save_pretrained(str(tmp / "transformer"), safe_serialization=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.replace(tmp, out)
    print(json.dumps({"export": str(out), "checkpoint": str(ckpt), "lora": checkpoint_is_lora(ckpt),
                      "files": sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())}))
    return 0


def cmd_memory(args) -> int:
    from .memory import estimate, format_table

    cfg = _load(args.config, args.overrides)
    try:
        worlds = [positive_int(w) for w in args.world_size.split(",")]
    except (ValueError, argparse.ArgumentTypeError):
        raise FlowRLError(f"--world-size {args.world_size}: give process counts separated by commas, e.g. 1,8")
    result = estimate(cfg, worlds, fsdp=args.fsdp, shard_size=args.shard_size)
    print(json.dumps(result, indent=1) if args.json else format_table(result))
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
    from .report import atomic_write_bytes, compare_runs, format_rank_table, plot_rank, rank_runs, write_csv

    if bool(args.runs) == bool(args.plan):
        raise FlowRLError("flowrl rank: give run directories, or --plan FILE (not both)")
    baseline = args.baseline
    if args.plan:
        from .report.plan import read_plan, run_plan

        runs = run_plan(Path(args.plan), Path(args.out), args.jobs, args.labels)
        baseline = baseline or read_plan(Path(args.plan))[0].get("baseline")
        if not runs:
            raise FlowRLError(f"{args.plan}: no run of the plan finished (see {Path(args.out) / 'logs'})")
    else:
        runs = [Path(d) for d in args.runs]
        for d in runs:
            if not d.is_dir():
                raise FlowRLError(f"{d}: not a directory")
    table, baseline = rank_runs(runs, baseline, metric=args.metric)
    text = format_rank_table(table, baseline)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / "rank.md", (text + "\n").encode())
    write_csv(out / "rank.csv", [{**r, "seeds": " ".join(map(str, r["seeds"]))} for r in table], list(table[0]))
    plot_rank(table, baseline, out / "rank.png")
    if args.plan:  # the training reward against time, mean +- SE over seeds
        compare_runs(runs, out, "time", "reward_mean/total", band="se")
    print(text)
    return 0


def cmd_bench_gpu(args) -> int:
    from .gpu_bench import run_gpu_bench

    if not args.tiny and not torch_cuda_available():
        raise FlowRLError("bench-gpu: no CUDA device here; run it on a GPU machine, or add --tiny for the CPU check")
    rows = run_gpu_bench(tuple(args.families), tuple(args.resolutions), args.batch, args.prompts, args.peak_tflops,
                         tiny=args.tiny, steps=args.steps, chains=args.chains,
                         attention_backend=args.attention_backend)
    if args.out:
        from .report import atomic_write_bytes

        atomic_write_bytes(Path(args.out), json.dumps(rows, indent=1).encode())
    return 0


def cmd_gpu_check(args) -> int:
    from .gpu_check import STAGES, run_check, run_stage

    if args.stage:  # one stage, in the process run_check started for it
        run_stage(args.stage, args.tiny, Path(args.stage_out))
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


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def cmd_bench(args) -> int:
    from .bench import alternate, compare_table, memory_growth, run_bench

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
    # the side-by-side ratios from configs timed in turns (A B C A B C ...), medians and spread
    names = [r["config"] for r in results]
    if len(set(names)) < len(names):  # the same config twice (a noise check): number them
        names = [f"{i + 1}. {n}" for i, n in enumerate(names)]
    alternated = alternate([_load(path, overrides) for path in configs], names, args.rounds)
    print(json.dumps({"runs": results, "side_by_side": compare_table(results), "alternated": alternated}, indent=1))
    return 0


def cmd_eval(args) -> int:
    """The config's held-out evaluation (log.eval; one JSON line) of the shipped model (no arguments: the main
    job's preset) or of a run's checkpoint; with
    --prompts / --reward, the papers' reward table (mean and std per metric) on a prompt file, also as CSV."""
    from .evaluate import format_table, group_means, per_prompt_means, reward_table
    from .models import load_adapter
    from .policy import load_trained_weights
    from .report import atomic_write_bytes, save_grid, write_csv
    from .sampling import Sampler, resolve_device

    if args.compare:
        return _eval_compare(args)
    ckpt, cfg = _checkpoint_and_config(args, Path(DEFAULT_PRESET))
    table_mode = bool(args.prompts or args.reward or args.dataset)
    if table_mode:  # everything that can fail on bad input before any sampling
        prompts, metadata, reward_set = _table_inputs(args, cfg)
    seeds = parse_seeds(args.seeds) if args.seeds else cfg.log.eval_seeds
    evaluator = None if table_mode else _evaluator(cfg)
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
    save_grid(images, len(seeds), grid, row_labels=prompts[:grid_prompts])
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


def finite_json(obj):
    """``obj`` with every NaN or infinite number replaced by None (strict JSON parsers refuse NaN)."""
    import math

    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


def _table_inputs(args, cfg):
    """The reward table's prompts, metadata and rewards from --dataset / --prompts / the evaluator's split (else the
    config's own prompts) and --reward (else the config's rewards); bad input fails here, before any model loads."""
    from .config import RewardSpec
    from .prompts import prompt_set, read_prompt_file
    from .rewards import build_reward_set
    from .rundir import check_writable

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
        from .prompts import read_dataset

        prompts, metadata = read_dataset(args.dataset, args.dataset_split, args.prompt_column)
        if args.limit:
            prompts, metadata = prompts[:args.limit], metadata[:args.limit]
    elif args.prompts:
        prompts, metadata = read_prompt_file(args.prompts)
        if not prompts:
            raise FlowRLError(f"--prompts {args.prompts}: the file holds no prompts")
    elif cfg.log.eval != "none":
        prompts = prompt_set(_split_name(args.split, cfg))
        metadata = [{} for _ in prompts]
    else:  # no evaluator to name a held-out set: the config's own prompts
        from .prompts import PromptSource

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

    from .checkpoint import find_checkpoint, lora_rank
    from .config import load_config
    from .evaluate import format_table, reward_table
    from .models import load_adapter
    from .policy import load_trained_weights
    from .report import atomic_write_bytes, save_grid, write_csv
    from .sampling import Sampler, resolve_device

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
        cfg = load_config(args.config or source.parent.parent / "config.yaml", args.overrides)
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


def cmd_presets(args) -> int:
    """The shipped presets: each config's name and the command line its header starts with."""
    from .resources import configs_dir

    for path in sorted(configs_dir().glob("*.yaml")):
        first = path.read_text().splitlines()[0].lstrip("# ").strip() if path.stat().st_size else ""
        print(f"{path.stem:34s} {first}")
    return 0


def cmd_config(args) -> int:
    """``config schema``: the JSON Schema of config files; ``config explain KEY``: one key's type, default, range
    and description."""
    from .config import explain, json_schema

    if args.action == "schema":
        print(json.dumps(json_schema(), indent=1))
    else:
        if not args.key:
            raise FlowRLError("flowrl config explain needs a KEY, e.g. flowrl config explain train.kl_beta")
        print(explain(args.key))
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


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="flowrl", description="GRPO fine-tuning of flow-matching models.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="fine-tune with a config file and key.sub=value overrides",
                       epilog="Every config key, its type, default, range and meaning: `flowrl config explain KEY` "
                              "(e.g. flowrl config explain train.kl_beta; a section such as `train` lists its keys), "
                              "`flowrl config schema` for all of them, `flowrl presets` for the shipped configs.")
    t.add_argument("config", nargs="?", help="YAML config or a shipped preset's file name (defaults: the tiny "
                   "model, JPEG reward)")
    t.add_argument("overrides", nargs="*", help="key.sub=value overrides such as train.lr=1e-4 "
                   "algorithm.group_size=8 rewards[0].name=clip")
    t.set_defaults(func=cmd_train)
    s = sub.add_parser("sample", help="grid of prompts x seeds from the base model, or base | checkpoint side by side")
    s.add_argument("config", nargs="?")
    s.add_argument("overrides", nargs="*")
    s.add_argument("--checkpoint", help="checkpoint folder or run directory (the weights it ended with: "
                   "checkpoints/best when the run restored them, else its latest; LoRA or full fine-tuning)")
    s.add_argument("--iteration", type=int, help="with a run directory: the checkpoint saved after this iteration")
    s.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    s.add_argument("--prompt", action="append", help="prompt (repeatable); default: the config's sample prompts")
    s.add_argument("--seeds", help="comma-separated seeds and ranges: 0,1,2 or 16-31")
    s.add_argument("--steps", type=int, help="ODE steps (default sampler.eval_num_steps)")
    s.add_argument("--out", default="samples.png", help="the grid image (PNG; a video model also writes .gif and .mp4)")
    s.set_defaults(func=cmd_sample)
    x = sub.add_parser("export", help="a run's weights as diffusers files: the LoRA file (load_lora_weights) or the "
                       "full transformer folder (from_pretrained), gathered from a sharded checkpoint")
    x.add_argument("checkpoint", help="run directory (its final weights) or checkpoint folder")
    x.add_argument("--iteration", type=int, help="with a run directory: the checkpoint saved after this iteration")
    x.add_argument("--out", required=True, help="a new folder")
    x.set_defaults(func=cmd_export)
    m = sub.add_parser("memory", help="GiB per process to train a config (weights, gradients, optimizer, EMA, "
                       "reference, activations) at given world sizes, from the architecture on the meta device")
    m.add_argument("config", nargs="?")
    m.add_argument("overrides", nargs="*")
    m.add_argument("--world-size", default="1", help="process counts, comma-separated (e.g. 1,8)")
    m.add_argument("--fsdp", action=argparse.BooleanOptionalAction, default=None,
                   help="shard (or not) whatever train.fsdp.enabled says")
    m.add_argument("--shard-size", type=positive_int, help="processes per shard group (HSDP), default all")
    m.add_argument("--json", action="store_true", help="the numbers as JSON")
    m.set_defaults(func=cmd_memory)
    c = sub.add_parser("compare", help="reward or held-out curves of several runs (seed bands), PNG, CSV and a "
                         "summary: final values and what each run spent to reach the first run's final value")
    c.add_argument("runs", nargs="+", help="run directories")
    c.add_argument("--x", default="iteration", choices=["iteration", "nfe", "rollouts", "time"],
                   help="the x axis: iterations, transformer evaluations, leaves rolled out or training seconds")
    c.add_argument("--metric", default="reward_mean/total",
                   help="a logged metric, or heldout/all / heldout/reward (the log.eval_every curve)")
    c.add_argument("--smoothing", type=positive_int, default=1, help="moving-average window in points (>= 1)")
    c.add_argument("--out", default="compare", help="folder for the PNG, CSV and summary")
    c.add_argument("--band", choices=["minmax", "se"], default="minmax",
                   help="seed band: min-max, or +-1 standard error of the mean")
    c.set_defaults(func=cmd_compare)
    rk = sub.add_parser("rank", help="ranked preset table from finished runs: held-out gain mean +- standard error "
                        "over seeds, reward, cleanliness, time, images; differences from a baseline beyond 2 SE; "
                        "rank.md, rank.csv and the figure rank.png")
    rk.add_argument("runs", nargs="*", help="run directories (runs differing only in train.seed form one preset)")
    rk.add_argument("--plan", help="a plan file (configs/benchmarks/ranked.yaml): train its missing runs into --out "
                    "first, then rank them; also draws their reward curves against time (compare.png)")
    rk.add_argument("--jobs", type=positive_int, default=None, help="with --plan: runs at a time (default: the plan's)")
    rk.add_argument("--labels", nargs="+", help="with --plan: only these labels")
    rk.add_argument("--baseline", help="the preset label compared against (default: the first run's)")
    rk.add_argument("--out", default="rank", help="folder for rank.csv and rank.md")
    rk.add_argument("--metric", default=None, help="the held-out number to rank by (default: the evaluator's headline, "
                    "named in each run's eval.json)")
    rk.set_defaults(func=cmd_rank)
    gc = sub.add_parser("gpu-check", help="the prepared GPU check: benchmark, sharded run, GPU tests and the main job, "
                        "each stage in its own process and time budget; JSON and Markdown into --out")
    gc.add_argument("--tiny", action="store_true", help="the same stages on a CPU with tiny models")
    gc.add_argument("--out", default="gpu_check", help="folder for gpu_check.json and gpu_check.md (a new one)")
    gc.add_argument("--only", nargs="+", metavar="STAGE", help="run only these stages")
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
    b.set_defaults(func=cmd_bench)
    bg = sub.add_parser("bench-gpu", help="SD3.5-Medium- and FLUX.1-sized transformers (random weights, real configs): "
                        "LoRA GRPO update step and flat / tree rollouts; time, images/s, TFLOP/s, MFU, peak memory")
    bg.add_argument("--families", nargs="+", default=["sd35m", "flux1"], choices=["sd35m", "flux1", "flux2k", "qwen", "wan13", "wan14"],
                    help="architectures to build (SD3.5-M, FLUX.1-dev, FLUX.2 [klein] 4B, Qwen-Image, Wan 2.1 1.3B / 14B)")
    bg.add_argument("--resolutions", nargs="+", type=positive_int, default=[512, 1024], help="image sides in pixels")
    bg.add_argument("--batch", type=batch_size, default=4, help="edges per update step, or auto: the micro-batch "
                    "train.micro_batch=auto picks for the family's preset on this device")
    bg.add_argument("--prompts", type=positive_int, default=2, help="prompts per rollout")
    bg.add_argument("--steps", type=positive_int, default=20, help="denoising steps per rollout")
    bg.add_argument("--chains", type=power_of_two, default=16, help="leaves per prompt: flat chains, or the tree's "
                    "leaves (branch 2 at steps 0, 3, 6, ...)")
    bg.add_argument("--attention-backend", default="native", choices=["native", "native_cudnn"],
                    help="the SDPA kernels (train.attention_backend)")
    bg.add_argument("--peak-tflops", type=float, default=989.0, help="the device's dense bf16 peak (H100/H200 SXM: 989)")
    bg.add_argument("--tiny", action="store_true", help="shrunken models at 64 px: the same code path on a CPU")
    bg.add_argument("--out", help="also write the rows to this JSON file")
    bg.set_defaults(func=cmd_bench_gpu)
    e = sub.add_parser("eval", help="the config's held-out evaluation (log.eval; one JSON line), or with --prompts/--reward a "
                       "reward table + CSV")
    e.add_argument("config", nargs="?")
    e.add_argument("overrides", nargs="*")
    e.add_argument("--checkpoint", help="checkpoint folder or run directory (LoRA or full fine-tuning)")
    e.add_argument("--iteration", type=int, help="with a run directory: the checkpoint saved after this iteration")
    e.add_argument("--split", default="heldout",
                   help="heldout or train: the captions the config's evaluator (log.eval) holds out or trains on; or "
                        "a prompt set by name")
    e.add_argument("--seeds", help="comma-separated seeds and ranges, 0,1,2 or 16-31 (default log.eval_seeds)")
    e.add_argument("--steps", type=int, help="ODE steps (default sampler.eval_num_steps)")
    e.add_argument("--cfg", type=float, help="guidance scale (default sampler.guidance_scale)")
    e.add_argument("--prompts", help="prompt file (.txt one per line, or .jsonl with 'prompt' and metadata): "
                   "print the reward table instead of the held-out evaluation")
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
    ps = sub.add_parser("presets", help="list the shipped configs (usable by name from any folder)")
    ps.set_defaults(func=cmd_presets)
    cf = sub.add_parser("config", help="config reference: `schema` prints the JSON Schema of config files (for editors), "
                                       "`explain KEY` a key's type, default, range and description")
    cf.add_argument("action", choices=["schema", "explain"], help="schema: the JSON Schema; explain: one key or section")
    cf.add_argument("key", nargs="?", help="explain: a dotted key such as train.kl_beta")
    cf.set_defaults(func=cmd_config)
    sr = sub.add_parser("serve-reward", help="serve a reward over HTTP (POST /score) for the `remote` reward")
    sr.add_argument("name", help="registered reward name or module:function")
    sr.add_argument("--args", help="the reward's keyword arguments as a JSON object")
    sr.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 serves other machines)")
    sr.add_argument("--port", type=port, default=8765, help="0 picks a free port (printed on the first line)")
    sr.add_argument("--max-mb", type=positive_number, default=64.0, help="largest request body accepted, in MiB")
    sr.set_defaults(func=cmd_serve_reward)

    for name in COMMANDS.names():  # commands that plug-ins register or install (the tiny demo's pretraining among them)
        COMMANDS.resolve(name)(sub)
    for sp in sub.choices.values():  # the positional arguments every config-taking command shares
        for action in sp._actions:
            if action.help is None and action.dest in _SHARED_HELP:
                action.help = _SHARED_HELP[action.dest]
    return p


_SHARED_HELP = {"config": "YAML config, or a shipped preset's file name (`flowrl presets`)",
                "overrides": "key.sub=value overrides applied after the file (`flowrl config explain KEY`)"}


def cli_reference_markdown() -> str:
    """Every subcommand with its purpose, usage line and options, as Markdown, read from the parser itself.

    Returns:
        Markdown with one ``###`` heading per subcommand (including those plug-ins register).
    """
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in sub._choices_actions}
    out = []
    for name, sp in sub.choices.items():
        usage = " ".join(sp.format_usage().split())[len("usage: "):]
        out += [f"### `flowrl {name}`", "", (helps.get(name) or "").rstrip(".") + ".", "", "```text", usage, "```", ""]
        rows = []
        for action in sp._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            names = ", ".join(action.option_strings) or action.dest
            default = "" if action.default in (None, argparse.SUPPRESS, False) or not action.option_strings \
                else f"`{action.default}`"
            choices = ", ".join(map(str, action.choices)) if action.choices else ""
            text = (action.help or "").replace("|", "\\|")
            rows.append(f"| `{names}` | {default} | {choices} | {text} |")
        if rows:
            out += ["| argument | default | choices | meaning |", "|---|---|---|---|", *rows, ""]
        if sp.epilog:
            out += [sp.epilog, ""]
    return "\n".join(out)


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
        launched_rank = int(os.environ.get("RANK", "0") or 0) if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 else 0
        if not (isinstance(exc, ConfigError) and launched_rank):  # every process refuses alike: the main one says so
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
