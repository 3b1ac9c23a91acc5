"""Several runs side by side: reward or held-out curves against iterations, rollouts or seconds (compare), and
the ranked table of held-out gains over seeds (rank)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from ..errors import FlowRLError
from .files import number, read_metrics, save_figure, write_csv
from .plots import smooth


def _run_label(run_dir: Path) -> tuple[str, int]:
    """(label without the seed, seed): runs differing only in train.seed share a label (a seed band)."""
    import yaml

    cfg_path = run_dir / "config.yaml"
    if not cfg_path.is_file():
        return run_dir.name, 0
    cfg = yaml.safe_load(cfg_path.read_text()) or {}
    seed = int(cfg.get("train", {}).get("seed", 0))
    algo = cfg.get("algorithm", {}).get("name", "?")
    label = cfg.get("log", {}).get("run_name") or run_dir.name
    base = re.sub(r"[-_](seed|s)\d+$", "", label)  # name-seed0, name_seed1, name_s2 -> one band
    return (base, seed) if base != label else (f"{algo}:{label}", seed)


X_AXES = {"iteration": "iteration", "nfe": "nfe_rollout_cum", "rollouts": "rollouts_cum", "time": "seconds_cum",
          "evaluations": "evaluations_cum"}
X_NAMES = {"iteration": "iteration", "nfe": "rollout NFE (cumulative)",
           "evaluations": "transformer evaluations, rollout + update (cumulative)", "rollouts": "images rolled out (cumulative)",
           "time": "training seconds (cumulative)"}
HELDOUT = "heldout/"  # heldout/<key>: the held-out curve's number <key>, read from eval_curve.jsonl (log.eval_every)


def _run_series(rd: Path, metric: str, x_axis: str, smoothing: int) -> tuple[list[float], list[float]]:
    held_out = metric.startswith(HELDOUT)
    source = "eval_curve.jsonl" if held_out else "metrics.jsonl"
    rows = read_metrics(Path(rd) / source)
    if not rows:
        hint = "; train with log.eval=<an evaluator> log.eval_every=N" if held_out else ""
        raise FlowRLError(f"{rd}: no {source} rows; is this a flowrl run directory{hint}?")
    key = metric[len(HELDOUT):] if held_out else metric
    if key not in rows[0]:
        numbers = [k for k, v in rows[0].items() if isinstance(v, (int, float)) and not k.endswith("_cum")]
        avail = ", ".join([HELDOUT + k for k in numbers if k != "iteration"] if held_out else
                          [k for k in numbers if k.startswith("reward")])
        raise FlowRLError(f"{rd}: metric {metric!r} not logged (available: {avail})")
    if X_AXES[x_axis] not in rows[-1]:
        raise FlowRLError(f"{rd}: {X_AXES[x_axis]} is not logged by this run (older flowrl); use another --x")
    xs = [r[X_AXES[x_axis]] for r in rows]
    return xs, smooth([number(r[key]) for r in rows], smoothing)


def _first_reach(xs: list[float], ys: list[float], target: float) -> float | None:
    return next((x for x, y in zip(xs, ys) if y >= target), None)


MAX_LINES = 10  # matplotlib's default cycle has ten colours; beyond them labels get panels


def compare_runs(run_dirs: list[Path], out_dir: Path, x_axis: str = "iteration", metric: str = "reward_mean/total",
                 smoothing: int = 1, band: str = "minmax") -> tuple[Path, Path, list[dict]]:
    """Plot ``metric`` of several runs against iteration / rollout NFE / images / training time; runs that differ
    only in seed are drawn as one mean line with a band: min-max over seeds, or (``band="se"``) mean +- the
    standard error of the mean. Up to ten labels share one axes; more get one panel each, with the first label
    drawn in grey behind every panel. ``heldout/<key>`` reads the held-out curve's number ``<key>``
    (eval_curve.jsonl; fractions in [0, 1] are drawn in %). Writes compare.png and compare.csv and returns a summary per label: start
    and final values (mean, min, max over seeds), the x spent, and the x each seed needed to first reach the
    first label's mean final value (``reach_*``; the first label is the reference)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if x_axis not in X_AXES:
        raise FlowRLError(f"--x must be one of {', '.join(X_AXES)}")
    groups: dict[str, list[tuple[int, list[float], list[float]]]] = {}
    csv_rows = []
    for rd in run_dirs:
        xs, ys = _run_series(Path(rd), metric, x_axis, smoothing)
        label, seed = _run_label(Path(rd))
        groups.setdefault(label, []).append((seed, xs, ys))
        csv_rows += [{"run": str(rd), "label": label, "seed": seed, x_axis: x, metric: y} for x, y in zip(xs, ys)]
    fractions = metric.startswith(HELDOUT) and all(0 <= y <= 1 for runs in groups.values() for r in runs for y in r[2])
    scale = 100.0 if fractions else 1.0  # accuracies drawn in %
    y_name = (metric + " (%)" if scale != 1 else metric) + (f" (smoothed {smoothing})" if smoothing > 1 else "")
    marker = "." if metric.startswith(HELDOUT) else None

    def draw(ax, runs, color, label):  # one label: the mean over seeds and its band
        n = min(len(r[1]) for r in runs)
        xs = [sum(r[1][j] for r in runs) / len(runs) for j in range(n)]
        ys = [[scale * r[2][j] for r in runs] for j in range(n)]
        mean = [sum(v) / len(v) for v in ys]
        ax.plot(xs, mean, color=color, marker=marker, label=f"{label} ({len(runs)} seed{'s' if len(runs) > 1 else ''})")
        if len(runs) > 1 and band == "se":
            se = [_stderr(v) for v in ys]
            lo, hi = [m - e for m, e in zip(mean, se)], [m + e for m, e in zip(mean, se)]
        elif len(runs) > 1:
            lo, hi = [min(v) for v in ys], [max(v) for v in ys]
        else:
            return
        ax.fill_between(xs, lo, hi, color=color, alpha=0.2)

    band_name = "+-1 standard error of the mean over seeds" if band == "se" else "min-max over seeds"
    if len(groups) <= MAX_LINES:  # one axes: every label in its own colour
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for i, (label, runs) in enumerate(groups.items()):
            draw(ax, runs, f"C{i}", label)
        ax.set_title(f"bands: {band_name}", fontsize=8)
        ax.set_xlabel(X_NAMES[x_axis])
        ax.set_ylabel(y_name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    else:  # more labels than distinguishable colours: one small panel per label, the first label in grey behind
        cols = 5
        rows = -(-len(groups) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(2.6 * cols, 2.0 * rows + 0.6), sharex=True, squeeze=False)
        (ref_label, ref_runs), *_ = groups.items()
        for ax, (label, runs) in zip(axes.flat, groups.items()):
            if label != ref_label:
                draw(ax, ref_runs, "0.6", ref_label)
            draw(ax, runs, "C0", label)
            ax.set_title(f"{label} ({len(runs)})", fontsize=8)
            ax.tick_params(labelsize=6)
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(groups):]:
            ax.set_visible(False)
        fig.suptitle(f"{y_name} against {X_NAMES[x_axis]}; grey: {ref_label}; bands: {band_name}; "
                     "seeds in brackets; each panel has its own y scale", fontsize=9)
        fig.tight_layout()
    # summary: the reference is the first label given
    reference = None
    summary = []
    for label, runs in groups.items():
        finals, starts = [r[2][-1] for r in runs], [r[2][0] for r in runs]
        mean_final = sum(finals) / len(finals)
        reference = mean_final if reference is None else reference
        spent = sum(r[1][-1] for r in runs) / len(runs)
        reach = [_first_reach(r[1], r[2], reference) for r in runs]
        summary.append({"label": label, "seeds": sorted(r[0] for r in runs), "start": round(sum(starts) / len(starts), 4),
                        "final_mean": round(mean_final, 4), "final_min": round(min(finals), 4),
                        "final_max": round(max(finals), 4), f"{x_axis}_spent": round(spent, 1),
                        f"reach_{x_axis}": [None if x is None else round(x, 1) for x in reach],
                        "reach_target": round(reference, 4)})
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / "compare.png"
    save_figure(fig, png)
    csv_path = out_dir / "compare.csv"
    write_csv(csv_path, csv_rows, ["run", "label", "seed", x_axis, metric])
    return png, csv_path, summary


def _stderr(values: list[float]) -> float:
    """Standard error of the mean (sample std with ddof 1 over sqrt(n)); 0 for a single value."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    return (sum((v - mean) ** 2 for v in values) / (n - 1) / n) ** 0.5


def rank_runs(run_dirs: list[Path], baseline: str | None = None, max_se: float = 0.015,
              metric: str | None = None) -> tuple[list[dict], str]:
    """The ranked preset table from finished runs (``eval.json`` before / after, the last metrics row): per label
    (runs differing only in seed), the mean held-out gain of ``metric`` (default: the evaluator's headline number,
    named in eval.json) +- its standard error over seeds, the held-out reward after, the change of the number the
    evaluator watches for reward hacking (its ``watch``: after - before), training seconds and images rolled out;
    sorted by mean gain. Each label's difference from ``baseline`` (default: the first label given) is called
    significant when it exceeds two standard errors of the difference, sqrt(se^2 + se_base^2); ``se_ok`` says
    whether the label's standard error is within ``max_se`` (1.5 points). Returns (table, the baseline's label)."""
    groups: dict[str, list[dict]] = {}
    skipped = []
    for rd in map(Path, run_dirs):
        path = rd / "eval.json"
        ev = json.loads(path.read_text()) if path.is_file() else {}
        if "before" not in ev or "after" not in ev:  # unfinished, or trained without a held-out evaluator
            skipped.append(rd)
            continue
        about = ev.get("about", {})
        key, watch = metric or about.get("headline"), about.get("watch")
        b = {k: number(v) for k, v in ev["before"].items()}  # null: a non-finite number
        a = {k: number(v) for k, v in ev["after"].items()}
        if key not in b or key not in a:
            numbers = ", ".join(k for k, v in a.items() if isinstance(v, (int, float)))
            raise FlowRLError(f"{rd}: eval.json has no held-out number {key!r} to rank by; pass --metric (one of "
                              f"{numbers})")
        last = (read_metrics(rd / "metrics.jsonl") or [{}])[-1]
        label, seed = _run_label(rd)
        nan = float("nan")
        groups.setdefault(label, []).append({
            "seed": seed, "gain": a[key] - b[key], "before": b[key], "after": a[key], "reward_after": a.get("reward", nan),
            "watch_change": a.get(watch, nan) - b.get(watch, nan) if watch else nan, "metric": key, "watch": watch,
            "seconds": last.get("seconds_cum", nan), "rollouts": last.get("rollouts_cum", nan),
            "evaluations": last.get("evaluations_cum", nan), "iterations": last.get("iteration", -1) + 1})
    if skipped:  # a folder such as runs/*/ holds other runs too: named, not fatal
        print(f"flowrl rank: skipped {len(skipped)} run(s) without a finished held-out evaluation (eval.json with "
              f"'before' and 'after'): {', '.join(str(r) for r in skipped)}", file=sys.stderr)
    if not groups:
        raise FlowRLError(f"none of the {len(skipped)} runs has an eval.json with 'before' and 'after'; train with "
                          "log.eval=<an evaluator> to the end")
    if baseline is not None and baseline not in groups:
        raise FlowRLError(f"--baseline {baseline!r} is none of the labels: {', '.join(groups)}")
    base_label = baseline or next(iter(groups))
    table = []
    for label, runs in groups.items():
        gains = [r["gain"] for r in runs]
        def mean(key: str, runs=runs) -> float:
            return sum(r[key] for r in runs) / len(runs)

        table.append({"label": label, "seeds": sorted(r["seed"] for r in runs), "gain_mean": mean("gain"),
                      "gain_se": _stderr(gains) if len(runs) > 1 else None, "before_mean": mean("before"),
                      "after_mean": mean("after"),
                      "reward_after": mean("reward_after"), "watch_change": mean("watch_change"),
                      "metric": runs[0]["metric"], "watch": runs[0]["watch"],
                      "seconds": mean("seconds"), "rollouts": mean("rollouts"),
                      "evaluations": mean("evaluations"), "iterations": mean("iterations")})
    base = next(r for r in table if r["label"] == base_label)
    for row in table:
        row["se_ok"] = row["gain_se"] is not None and row["gain_se"] <= max_se
        row["diff_vs_baseline"] = row["gain_mean"] - base["gain_mean"]
        if row is base or row["gain_se"] is None or base["gain_se"] is None:
            row["significant"] = None
        else:
            se_diff = (row["gain_se"] ** 2 + base["gain_se"] ** 2) ** 0.5
            row["significant"] = abs(row["diff_vs_baseline"]) > 2 * se_diff
    table.sort(key=lambda r: -r["gain_mean"])
    return table, base_label


def _count(value) -> str:
    """A whole count with thousands separators; '-' where the runs did not log it (older runs)."""
    import math

    return "-" if value is None or not math.isfinite(value) else f"{value:,.0f}"


def format_rank_table(table: list[dict], baseline: str) -> str:
    """The ranked table as markdown (percentage points for gains; before -> after shows a preset evaluated on its own
    baseline, such as a CFG-free one)."""
    metric = table[0]["metric"] if table else "headline"
    watch = next((r["watch"] for r in table if r["watch"]), None)
    lines = [(f"| rank | preset | seeds | held-out {metric} gain (pts, mean +- SE) | before -> after | held-out reward | "
              f"{watch or 'watched number'} change | iterations | evaluations | seconds | images | vs {baseline} |"),
             "|" + "---|" * 12]
    for i, r in enumerate(table, 1):
        se = "n/a" if r["gain_se"] is None else f"{100 * r['gain_se']:.1f}" + ("" if r["se_ok"] else " (> 1.5)")
        sig = ("baseline" if r["label"] == baseline else "n/a" if r["significant"] is None else
               f"{100 * r['diff_vs_baseline']:+.1f} " + ("(> 2 SE)" if r["significant"] else "(within 2 SE)"))
        lines.append(f"| {i} | {r['label']} | {len(r['seeds'])} | {100 * r['gain_mean']:+.1f} +- {se} | "
                     f"{100 * r['before_mean']:.1f}% -> {100 * r['after_mean']:.1f}% | {r['reward_after']:.3f} | "
                     f"{r['watch_change']:+.1f} | {_count(r.get('iterations'))} | {_count(r.get('evaluations'))} | "
                     f"{r['seconds']:.0f} | {r['rollouts']:.0f} | {sig} |")
    return "\n".join(lines)


def plot_rank(table: list[dict], baseline: str, path: Path) -> Path:
    """The ranked table as a figure: each label's mean held-out gain (points) with +-1 and +-2 standard-error bars,
    the baseline's mean as a line and its +-2 SE as a band; labels whose difference from the baseline exceeds two
    standard errors of the difference in a stronger colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(reversed(table))  # best at the top
    fig, ax = plt.subplots(figsize=(8, 0.32 * len(rows) + 1.4))
    base = next(r for r in table if r["label"] == baseline)
    b_mean, b_se = 100 * base["gain_mean"], 100 * (base["gain_se"] or 0.0)
    ax.axvspan(b_mean - 2 * b_se, b_mean + 2 * b_se, color="0.9", zorder=0, label=f"{baseline} +- 2 SE")
    ax.axvline(b_mean, color="0.5", lw=1, zorder=1)
    ax.axvline(0, color="k", lw=0.6, zorder=1)
    for y, r in enumerate(rows):
        m, se = 100 * r["gain_mean"], 100 * (r["gain_se"] or 0.0)
        colour = "tab:blue" if r["significant"] else "tab:gray" if r["label"] != baseline else "k"
        ax.errorbar(m, y, xerr=2 * se, fmt="none", ecolor=colour, alpha=0.35, lw=4, zorder=2)
        ax.errorbar(m, y, xerr=se, fmt="o", color=colour, ecolor=colour, capsize=3, zorder=3)
    ax.set_yticks(range(len(rows)), [f"{r['label']} ({len(r['seeds'])})" for r in rows])
    metric = table[0]["metric"] if table else "held-out"
    ax.set_xlabel(f"held-out {metric} gain, points (dot +- 1 SE, bar +- 2 SE; seeds in brackets)")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    path = Path(path)
    save_figure(fig, path)
    return path
