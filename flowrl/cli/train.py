"""Training and configs: ``flowrl train``, ``memory``, ``presets`` and ``config``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..cli_types import positive_int
from ..errors import FlowRLError
from .common import load_cli_config


def cmd_train(args) -> int:
    from ..trainer import Trainer

    cfg = load_cli_config(args.config, args.overrides)
    name = Path(args.config).stem if args.config else "default"
    trainer = Trainer(cfg, config_name=name)
    if trainer.procs.is_main:
        print(f"run directory: {trainer.run_dir}" + (f" ({trainer.procs.processes} processes)" if trainer.procs.distributed
                                                     else ""), file=sys.stderr)
    run_dir = trainer.train()
    if not trainer.procs.is_main:
        return 0
    from ..report import read_metrics

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


def cmd_memory(args) -> int:
    from ..memory import estimate, format_table

    cfg = load_cli_config(args.config, args.overrides)
    try:
        worlds = [positive_int(w) for w in args.world_size.split(",")]
    except (ValueError, argparse.ArgumentTypeError):
        raise FlowRLError(f"--world-size {args.world_size}: give process counts separated by commas, e.g. 1,8")
    result = estimate(cfg, worlds, fsdp=args.fsdp, shard_size=args.shard_size)
    print(json.dumps(result, indent=1) if args.json else format_table(result))
    return 0


def cmd_presets(args) -> int:
    """The shipped presets: each config's name and the command line its header starts with."""
    from ..resources import configs_dir

    for path in sorted(configs_dir().glob("*.yaml")):
        first = path.read_text().splitlines()[0].lstrip("# ").strip() if path.stat().st_size else ""
        print(f"{path.stem:34s} {first}")
    return 0


def cmd_config(args) -> int:
    """``config schema``: the JSON Schema of config files; ``config explain KEY``: one key's type, default, range
    and description."""
    from ..config import explain, json_schema

    if args.action == "schema":
        print(json.dumps(json_schema(), indent=1))
    else:
        if not args.key:
            raise FlowRLError("flowrl config explain needs a KEY, e.g. flowrl config explain train.kl_beta")
        print(explain(args.key))
    return 0


def add_parsers(sub) -> None:
    """This group's subcommands on the ``flowrl`` parser's ``sub``."""
    t = sub.add_parser("train", help="fine-tune with a config file and key.sub=value overrides",
                       epilog="Every config key, its type, default, range and meaning: `flowrl config explain KEY` "
                              "(e.g. flowrl config explain train.kl_beta; a section such as `train` lists its keys), "
                              "`flowrl config schema` for all of them, `flowrl presets` for the shipped configs.")
    t.add_argument("config", nargs="?", help="YAML config or a shipped preset's file name (defaults: the tiny "
                   "model, JPEG reward)")
    t.add_argument("overrides", nargs="*", help="key.sub=value overrides such as train.lr=1e-4 "
                   "algorithm.group_size=8 rewards[0].name=clip")
    t.set_defaults(func=cmd_train)
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
    ps = sub.add_parser("presets", help="list the shipped configs (usable by name from any folder)")
    ps.set_defaults(func=cmd_presets)
    cf = sub.add_parser("config", help="config reference: `schema` prints the JSON Schema of config files (for editors), "
                                       "`explain KEY` a key's type, default, range and description")
    cf.add_argument("action", choices=["schema", "explain"], help="schema: the JSON Schema; explain: one key or section")
    cf.add_argument("key", nargs="?", help="explain: a dotted key such as train.kl_beta")
    cf.set_defaults(func=cmd_config)
