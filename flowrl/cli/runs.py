"""Runs side by side: ``flowrl compare`` (curves) and ``rank`` (the ranked preset table)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..cli_types import positive_int
from ..errors import FlowRLError


def cmd_compare(args) -> int:
    from ..report import compare_runs

    for d in args.runs:
        if not Path(d).is_dir():
            raise FlowRLError(f"{d}: not a directory")
    png, csv_path, summary = compare_runs([Path(d) for d in args.runs], Path(args.out), args.x, args.metric,
                                          args.smoothing, band=args.band)
    print(json.dumps({"png": str(png), "csv": str(csv_path), "summary": summary}, indent=1))
    return 0


def cmd_rank(args) -> int:
    from ..report import atomic_write_bytes, compare_runs, format_rank_table, plot_rank, rank_runs, write_csv

    if bool(args.runs) == bool(args.plan):
        raise FlowRLError("flowrl rank: give run directories, or --plan FILE (not both)")
    baseline = args.baseline
    if args.plan:
        from ..report.plan import read_plan, run_plan

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
    curves = [r for r in runs if (Path(r) / "eval_curve.jsonl").is_file()]
    if curves:  # the held-out curve against iterations, transformer evaluations and seconds, mean +- SE over seeds
        for x in ("iteration", "evaluations", "time"):
            try:
                compare_runs(curves, out / f"heldout_vs_{x}", x, f"heldout/{table[0]['metric']}", band="se")
            except FlowRLError as exc:  # older runs without the counter: named, the table stands
                print(f"flowrl rank: no held-out curve against {x}: {exc}", file=sys.stderr)
    print(text)
    return 0


def add_parsers(sub) -> None:
    """This group's subcommands on the ``flowrl`` parser's ``sub``."""
    c = sub.add_parser("compare", help="reward or held-out curves of several runs (seed bands), PNG, CSV and a "
                         "summary: final values and what each run spent to reach the first run's final value")
    c.add_argument("runs", nargs="+", help="run directories")
    c.add_argument("--x", default="iteration", choices=["iteration", "nfe", "rollouts", "time", "evaluations"],
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
