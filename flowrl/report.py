"""Run-directory reports: metrics.jsonl, reward curves, sample grids and multi-run comparisons."""

from __future__ import annotations

import csv
import json
import os
import re
from pathlib import Path

import torch


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_csv(path: Path, rows: list[dict], fieldnames: list[str] | None = None) -> None:
    """CSV written whole and renamed into place, so an interrupted run leaves no half-written file."""
    import io

    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=fieldnames or (list(rows[0]) if rows else []))
    writer.writeheader()
    writer.writerows(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, buf.getvalue().encode("utf-8"))


def append_metrics(path: Path, row: dict) -> None:
    """One row, flushed to disk before returning (a crash loses at most the row being written)."""
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(row, sort_keys=False) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def read_metrics(path: Path, warn: bool = True) -> list[dict]:
    """Every readable row; a damaged line (cut by a crash, edited by hand) is skipped and named on stderr,
    and the rows after it are kept."""
    import sys

    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if isinstance(row, dict):
                rows.append(row)
            elif warn:
                print(f"flowrl: warning: {path}:{n} is not a metrics row; skipped", file=sys.stderr)
    return rows


def truncate_metrics(path: Path, before_iteration: int) -> list[dict]:
    """Keep only rows of iterations < ``before_iteration`` (used on resume); returns the rows removed."""
    if not Path(path).is_file():
        return []
    rows = read_metrics(path)
    keep = [r for r in rows if r.get("iteration", 0) < before_iteration]
    atomic_write_bytes(Path(path), "".join(json.dumps(r) + "\n" for r in keep).encode())
    return [r for r in rows if r.get("iteration", 0) >= before_iteration]


def _savefig(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}{path.suffix}")
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    plt.close(fig)
    os.replace(tmp, path)


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average over ``window`` points (window 1 = raw)."""
    out, acc = [], []
    for v in values:
        acc.append(v)
        if len(acc) > window:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def plot_reward_curve(run_dir: Path) -> Path | None:
    """reward_curve.png: mean reward (+- std band) per iteration, one panel per reward component."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir / "metrics.jsonl")
    if not rows:
        return None
    components = [k[len("reward_mean/"):] for k in rows[0] if k.startswith("reward_mean/") and k != "reward_mean/total"]
    panels = ["total"] + components if len(components) > 1 else ["total"]
    evals = {}
    if (run_dir / "eval.json").is_file():  # held-out accuracy before / after, next to the training reward
        evals = {k: v for k, v in json.loads((run_dir / "eval.json").read_text()).items() if isinstance(v, dict)}
    fig, axes = plt.subplots(1, len(panels) + bool(evals), figsize=(4.5 * (len(panels) + bool(evals)), 3.4),
                             squeeze=False)
    its = [r["iteration"] for r in rows]
    for ax, key in zip(axes[0], panels):
        mean = [r.get(f"reward_mean/{key}", float("nan")) for r in rows]
        std = [r.get(f"reward_std/{key}", 0.0) for r in rows]
        ax.plot(its, mean, color="C0", lw=1.2, label="mean")
        ax.fill_between(its, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], color="C0",
                        alpha=0.2, label="+-1 std")
        if len(mean) >= 5:
            ax.plot(its, smooth(mean, max(3, len(mean) // 10)), color="C3", lw=1.5, label="smoothed")
        ax.set_title(f"reward: {key} (training rollouts)")
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    if evals:
        ax = axes[0][-1]
        where, label = {"before": 0, "after": rows[-1]["iteration"] + 1}, "full evaluation"
        best = json.loads((run_dir / "best.json").read_text()) if (run_dir / "best.json").is_file() else {}
        if best.get("ended_with"):  # the run ended with its best curve point's weights: "after" is drawn there
            where["after"], label = best["iteration"], f"full evaluation (after: iteration {best['iteration']}'s weights)"
        points = [(where[k], 100 * v["all"]) for k, v in evals.items() if k in where and "all" in v]
        ax.plot([p[0] for p in points], [p[1] for p in points], "o-", color="C2", label=label)
        curve = read_metrics(run_dir / "eval_curve.jsonl")
        if curve:  # the periodic points use fewer seeds: noisier, drawn thinner
            unit = "videos" if "videos" in curve[0] else "images"
            ax.plot([c["iteration"] for c in curve], [100 * c["all"] for c in curve], ".--", color="C4", lw=1,
                    label=f"every log.eval_every ({curve[0].get(unit, 0)} {unit})")
            ax.legend(fontsize=7)
        for x, y in points:
            ax.annotate(f"{y:.1f}%", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
        ax.margins(x=0.1, y=0.3)
        attributes = "all four" if any("motion" in v for v in evals.values()) else "all three"  # video: + motion
        ax.set_title(f"held-out accuracy, {attributes} (ODE)")
        ax.set_xlabel("iteration")
        ax.set_ylabel("%")
        ax.grid(alpha=0.3)
    fig.suptitle(run_dir.name, fontsize=9)
    out = run_dir / "reward_curve.png"
    _savefig(fig, out)
    return out


def side_by_side(left: torch.Tensor, right: torch.Tensor, per_row: int) -> torch.Tensor:
    """Two row-major image sets with ``per_row`` images per row -> rows of ``left | right`` (2 * per_row)."""
    rows = left.shape[0] // per_row
    return torch.cat([torch.cat([left[i * per_row:(i + 1) * per_row], right[i * per_row:(i + 1) * per_row]])
                      for i in range(rows)])


def save_grid(images: torch.Tensor, nrow: int, path: Path, min_size: int = 64,
              row_labels: list[str] | None = None, title: str | None = None) -> Path:
    """images (N, 3, H, W) in [0, 1], row-major, -> PNG grid (nearest-upscaled so tiny images stay visible).
    Videos (N, F, 3, H, W): the PNG shows each sample's frames as a strip, and the grid as a video is written
    beside it (``<name>.gif`` and ``<name>.mp4``)."""
    if images.ndim == 5:
        save_video_grid(images, nrow, [path.with_suffix(".gif"), path.with_suffix(".mp4")], min_size)
        n, f = images.shape[:2]
        strips = images.permute(0, 2, 3, 1, 4).reshape(n, images.shape[2], images.shape[3], f * images.shape[4])
        return save_grid(strips, nrow, path, min_size, row_labels, (title or "") + f" ({f} frames per sample)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from torchvision.utils import make_grid

    h = images.shape[-1]
    if h < min_size:
        images = torch.nn.functional.interpolate(images, scale_factor=min_size // h, mode="nearest")
    grid = make_grid(images.clamp(0, 1), nrow=nrow, padding=2, pad_value=1.0)
    rows = (images.shape[0] + nrow - 1) // nrow
    fig_w = max(3.0, grid.shape[2] / 80) + (2.2 if row_labels else 0)
    fig, ax = plt.subplots(figsize=(fig_w, max(1.5, grid.shape[1] / 80) + 0.4))
    ax.imshow(grid.permute(1, 2, 0).numpy(), interpolation="nearest")
    ax.set_xticks([])
    if row_labels:
        step = grid.shape[1] / rows
        ax.set_yticks([step * (i + 0.5) for i in range(len(row_labels))])
        ax.set_yticklabels([lbl if len(lbl) < 40 else lbl[:37] + "..." for lbl in row_labels], fontsize=7)
    else:
        ax.set_yticks([])
    if title:
        ax.set_title(title, fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    _savefig(fig, path)
    return path


def save_video_grid(videos: torch.Tensor, nrow: int, paths: list[Path], min_size: int = 64, fps: int = 8) -> list[Path]:
    """videos (N, F, 3, H, W) in [0, 1] -> videos whose frame k is the grid of every sample's frame k, one per
    path: an animated GIF (Pillow) or, for ``.mp4``, H.264 through PyAV; each written to a temporary name and
    renamed."""
    from torchvision.utils import make_grid

    frames = []  # (H, W, 3) uint8 grids, built once for every format
    for k in range(videos.shape[1]):
        x = videos[:, k].clamp(0, 1)
        if x.shape[-1] < min_size:
            x = torch.nn.functional.interpolate(x, scale_factor=min_size // x.shape[-1], mode="nearest")
        grid = make_grid(x, nrow=nrow, padding=2, pad_value=1.0)
        frames.append((grid.permute(1, 2, 0) * 255).round().byte().numpy())
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
        if path.suffix == ".mp4":
            _write_mp4(frames, tmp, fps)
        else:
            from PIL import Image

            images = [Image.fromarray(f) for f in frames]
            images[0].save(tmp, format="GIF", save_all=True, append_images=images[1:], duration=int(1000 / fps), loop=0)
        os.replace(tmp, path)
    return paths


def _write_mp4(frames: list, path: Path, fps: int) -> None:
    import av
    import numpy as np

    h, w = frames[0].shape[:2]
    with av.open(str(path), mode="w") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height = w + w % 2, h + h % 2  # yuv420p needs even sizes
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "18"}
        for f in frames:
            f = np.pad(f, ((0, h % 2), (0, w % 2), (0, 0)), constant_values=255)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        out.mux(stream.encode())


# ------------------------------------------------------------------------------------------- compare
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


X_AXES = {"iteration": "iteration", "nfe": "nfe_rollout_cum", "rollouts": "rollouts_cum", "time": "seconds_cum"}
X_NAMES = {"iteration": "iteration", "nfe": "rollout NFE (cumulative)", "rollouts": "images rolled out (cumulative)",
           "time": "training seconds (cumulative)"}
HELDOUT = {"heldout/all": "all", "heldout/reward": "reward"}  # metrics read from eval_curve.jsonl (log.eval_every)


def _run_series(rd: Path, metric: str, x_axis: str, smoothing: int) -> tuple[list[float], list[float]]:
    from .errors import FlowRLError

    source = "eval_curve.jsonl" if metric in HELDOUT else "metrics.jsonl"
    rows = read_metrics(Path(rd) / source)
    if not rows:
        hint = "; train with log.eval=shapes log.eval_every=N" if metric in HELDOUT else ""
        raise FlowRLError(f"{rd}: no {source} rows; is this a flowrl run directory{hint}?")
    key = HELDOUT.get(metric, metric)
    if key not in rows[0]:
        avail = ", ".join([k for k in rows[0] if k.startswith("reward")] + list(HELDOUT))
        raise FlowRLError(f"{rd}: metric {metric!r} not logged (available: {avail})")
    if X_AXES[x_axis] not in rows[-1]:
        raise FlowRLError(f"{rd}: {X_AXES[x_axis]} is not logged by this run (older flowrl); use another --x")
    xs = [r[X_AXES[x_axis]] for r in rows]
    return xs, smooth([r[key] for r in rows], smoothing)


def _first_reach(xs: list[float], ys: list[float], target: float) -> float | None:
    return next((x for x, y in zip(xs, ys) if y >= target), None)


def compare_runs(run_dirs: list[Path], out_dir: Path, x_axis: str = "iteration", metric: str = "reward_mean/total",
                 smoothing: int = 1, band: str = "minmax") -> tuple[Path, Path, list[dict]]:
    """Plot ``metric`` of several runs against iteration / rollout NFE / images / training time; runs that differ
    only in seed are drawn as one mean line with a band: min-max over seeds, or (``band="se"``) mean +- the
    standard error of the mean. ``heldout/all`` and ``heldout/reward`` read the
    held-out curve (eval_curve.jsonl). Writes compare.png and compare.csv and returns a summary per label: start
    and final values (mean, min, max over seeds), the x spent, and the x each seed needed to first reach the
    first label's mean final value (``reach_*``; the first label is the reference)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .errors import FlowRLError

    if x_axis not in X_AXES:
        raise FlowRLError(f"--x must be one of {', '.join(X_AXES)}")
    groups: dict[str, list[tuple[int, list[float], list[float]]]] = {}
    csv_rows = []
    for rd in run_dirs:
        xs, ys = _run_series(Path(rd), metric, x_axis, smoothing)
        label, seed = _run_label(Path(rd))
        groups.setdefault(label, []).append((seed, xs, ys))
        csv_rows += [{"run": str(rd), "label": label, "seed": seed, x_axis: x, metric: y} for x, y in zip(xs, ys)]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    scale = 100.0 if metric == "heldout/all" else 1.0  # accuracy drawn in %
    for i, (label, runs) in enumerate(groups.items()):
        color = f"C{i % 10}"
        n = min(len(r[1]) for r in runs)
        xs = [sum(r[1][j] for r in runs) / len(runs) for j in range(n)]
        ys = [[scale * r[2][j] for r in runs] for j in range(n)]
        mean = [sum(v) / len(v) for v in ys]
        ax.plot(xs, mean, color=color, marker="." if metric in HELDOUT else None,
                label=f"{label} ({len(runs)} seed{'s' if len(runs) > 1 else ''})")
        if len(runs) > 1 and band == "se":
            se = [_stderr(v) for v in ys]
            ax.fill_between(xs, [m - e for m, e in zip(mean, se)], [m + e for m, e in zip(mean, se)], color=color,
                            alpha=0.2)
        elif len(runs) > 1:
            ax.fill_between(xs, [min(v) for v in ys], [max(v) for v in ys], color=color, alpha=0.2)
    if band == "se":
        ax.set_title("bands: +-1 standard error of the mean over seeds", fontsize=8)
    ax.set_xlabel(X_NAMES[x_axis])
    ax.set_ylabel((metric + " (%)" if scale != 1 else metric) + (f" (smoothed {smoothing})" if smoothing > 1 else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
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
    _savefig(fig, png)
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


def rank_runs(run_dirs: list[Path], baseline: str | None = None, max_se: float = 0.015) -> tuple[list[dict], str]:
    """The ranked preset table from finished runs (``eval.json`` before / after, the last metrics row): per label
    (runs differing only in seed), the mean held-out all-correct gain +- its standard error over seeds, the held-out
    reward after, the cleanliness change (background noise after - before), training seconds and images rolled
    out; sorted by mean gain. Each label's difference from ``baseline`` (default: the first label given) is called
    significant when it exceeds two standard errors of the difference, sqrt(se^2 + se_base^2); ``se_ok`` says
    whether the label's standard error is within ``max_se`` (1.5 points). Returns (table, the baseline's label)."""
    from .errors import FlowRLError

    groups: dict[str, list[dict]] = {}
    for rd in map(Path, run_dirs):
        path = rd / "eval.json"
        ev = json.loads(path.read_text()) if path.is_file() else {}
        if "before" not in ev or "after" not in ev:
            raise FlowRLError(f"{rd}: no eval.json with 'before' and 'after'; train with log.eval=shapes (or "
                              f"moving-shapes) to the end")
        last = (read_metrics(rd / "metrics.jsonl") or [{}])[-1]
        label, seed = _run_label(rd)
        b, a = ev["before"], ev["after"]
        groups.setdefault(label, []).append({
            "seed": seed, "gain": a["all"] - b["all"], "before": b["all"], "after": a["all"], "reward_after": a.get("reward", float("nan")),
            "noise_change": a.get("background_noise", float("nan")) - b.get("background_noise", float("nan")),
            "seconds": last.get("seconds_cum", float("nan")), "rollouts": last.get("rollouts_cum", float("nan"))})
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
                      "reward_after": mean("reward_after"), "noise_change": mean("noise_change"),
                      "seconds": mean("seconds"), "rollouts": mean("rollouts")})
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


def format_rank_table(table: list[dict], baseline: str) -> str:
    """The ranked table as markdown (percentage points for gains; before -> after shows a preset evaluated on its own
    baseline, such as a CFG-free one)."""
    lines = [(f"| rank | preset | seeds | held-out all gain (pts, mean +- SE) | before -> after | held-out reward | "
              f"background noise change | seconds | images | vs {baseline} |"), "|" + "---|" * 10]
    for i, r in enumerate(table, 1):
        se = "n/a" if r["gain_se"] is None else f"{100 * r['gain_se']:.1f}" + ("" if r["se_ok"] else " (> 1.5)")
        sig = ("baseline" if r["label"] == baseline else "n/a" if r["significant"] is None else
               f"{100 * r['diff_vs_baseline']:+.1f} " + ("(> 2 SE)" if r["significant"] else "(within 2 SE)"))
        lines.append(f"| {i} | {r['label']} | {len(r['seeds'])} | {100 * r['gain_mean']:+.1f} +- {se} | "
                     f"{100 * r['before_mean']:.1f}% -> {100 * r['after_mean']:.1f}% | {r['reward_after']:.3f} | "
                     f"{r['noise_change']:+.1f} | "
                     f"{r['seconds']:.0f} | {r['rollouts']:.0f} | {sig} |")
    return "\n".join(lines)
