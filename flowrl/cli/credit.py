"""``flowrl credit``: each transition method's step advantages against the Monte Carlo truth (flowrl/credit.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..cli_types import positive_int, seed
from ..errors import FlowRLError


def _labels(args) -> list[tuple[str, object]]:
    """(label, config) to measure: a rank plan's labels (each with its own config and overrides), or every
    registered transition algorithm with its defaults on CONFIG's model, sampler, rewards and group size."""
    from ..config import build_algorithm, load_config, validate
    from ..registry import ALGORITHMS, algorithm_class

    base_overrides = list(args.overrides) + ([f"sampler.num_steps={args.steps}"] if args.steps else [])
    if args.plan:
        from ..report.plan import read_plan

        plan, runs = read_plan(Path(args.plan))
        out, seen = [], set()
        for r in runs:
            if r.label in seen or (args.labels and r.label not in args.labels):
                continue
            seen.add(r.label)
            if any("{run:" in o for o in r.overrides):  # needs another run's weights (a teacher): not measurable here
                continue
            out.append((r.label, load_config(r.config, [*r.overrides, *base_overrides])))
        if args.labels and not out:
            raise FlowRLError(f"--labels: none of {args.labels} is a label of {args.plan}")
        return out
    from ..algorithms import TransitionAlgorithm

    cfg = load_config(args.config, base_overrides)
    group = getattr(cfg.algorithm, "group_size", 8)
    names = args.labels or [n for n in ALGORITHMS.names() if ":" not in n
                            and issubclass(algorithm_class(n), TransitionAlgorithm)]
    from ..errors import ConfigError

    out = []
    for name in names:
        options = algorithm_class(name).Options
        sections = [{"name": name, "group_size": group}] if "group_size" in options.model_fields else []
        problem = ""
        for section in sections + [{"name": name}]:  # CONFIG's group size where the method's tree allows it
            try:
                one = cfg.model_copy(update={"algorithm": build_algorithm(section)}, deep=True)
                one = validate(one)
                out.append((name, one))
                break
            except ConfigError as exc:
                problem = str(exc)
        else:
            out.append((name, f"its defaults do not fit this config: {problem}"))
    return out


def cmd_credit(args) -> int:
    from ..credit import LabelCredit, format_credit_table, measure_label, plot_credit
    from ..report import atomic_write_bytes
    from ..rundir import check_writable

    if args.continuations % 2 and args.antithetic:
        raise FlowRLError(f"--continuations {args.continuations}: antithetic draws come in pairs; give an even "
                          "number or --no-antithetic")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise FlowRLError(f"--out {out} exists and is not empty; choose a new folder")
    check_writable(out, "--out")
    labels = _labels(args)  # every config checked before any model loads
    rows = list(range(args.prompt_offset, args.prompt_offset + args.prompts))
    results, adapters = [], {}
    start = time.perf_counter()
    for name, cfg in labels:
        if isinstance(cfg, str):
            results.append(LabelCredit(name, name, None, 0, 0, float("nan"), 0, 0.0, skipped=cfg))
            continue
        try:
            r = measure_label(name, cfg, rows, args.continuations, args.seed, args.antithetic, not args.quiet,
                              adapters)
        # one method's failure is named in its row; the rest are measured
        except (FlowRLError, AttributeError, ValueError, RuntimeError) as exc:
            why = (str(exc).strip().splitlines() or [""])[0][:160]
            r = LabelCredit(name, cfg.algorithm.name, None, 0, 0, float("nan"), 0, 0.0,
                            skipped=f"could not be measured here: {type(exc).__name__}: {why}")
        results.append(r)
        if not args.quiet:
            print(f"{name}: " + (f"pearson {r.agreement.pearson:+.3f} over {r.trained} transitions "
                                 f"({r.seconds:.0f} s)" if r.agreement else r.skipped), flush=True)
    table = format_credit_table(results)
    out.mkdir(parents=True, exist_ok=True)
    import sys

    command = "flowrl " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["credit"] else "flowrl credit"
    meta = {"command": command, "prompts": args.prompts,
            "continuations": args.continuations, "antithetic": args.antithetic, "seed": args.seed,
            "seconds": round(time.perf_counter() - start, 1)}
    atomic_write_bytes(out / "credit.json", json.dumps({**meta, "labels": [r.as_dict() for r in results]},
                                                        indent=1, default=str).encode())
    atomic_write_bytes(out / "credit.md", (f"`{meta['command']}` ({meta['seconds']} s)\n\n{table}\n").encode())
    plot_credit(results, out / "credit_per_step.png")
    print(table)
    print(f"({meta['seconds']} s; {out / 'credit.json'}, credit.md, credit_per_step.png)")
    return 0


def add_parsers(sub) -> None:
    c = sub.add_parser("credit", help="each transition method's step advantages against the true per-step credit "
                       "(Monte Carlo Q - V with paired, antithetic continuations): correlation, sign agreement, "
                       "per step; a table, JSON and a plot")
    c.add_argument("config", nargs="?")
    c.add_argument("overrides", nargs="*")
    c.add_argument("--plan", help="a rank plan (configs/benchmarks/ranked.yaml): measure its labels, each with its "
                   "own config and overrides; default: every registered transition algorithm with its defaults on "
                   "CONFIG")
    c.add_argument("--labels", nargs="+", help="only these labels (or algorithm names)")
    c.add_argument("--prompts", type=positive_int, default=2, help="prompts (each one group of the method's own size)")
    c.add_argument("--prompt-offset", type=int, default=0, help="first prompt of the config's training prompts")
    c.add_argument("--continuations", type=positive_int, default=8,
                   help="Monte Carlo continuations per state (M); even with antithetic pairs")
    c.add_argument("--no-antithetic", dest="antithetic", action="store_false",
                   help="independent continuation noise instead of mirrored pairs")
    c.add_argument("--steps", type=positive_int, help="denoising steps (default: each config's sampler.num_steps)")
    c.add_argument("--seed", type=seed, default=0, help="the rollout's and the continuations' seed")
    c.add_argument("--out", default="credit", help="a new folder for credit.json, credit.md and credit_per_step.png")
    c.add_argument("--quiet", action="store_true", help="no progress bars")
    c.set_defaults(func=cmd_credit)
