"""The reward curve of a run: the training reward per iteration beside the held-out curve."""

from __future__ import annotations

import json
from pathlib import Path

from .files import number, read_metrics, save_figure


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average over ``window`` points (window 1 = raw)."""
    out, acc = [], []
    for v in values:
        acc.append(v)
        if len(acc) > window:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def _json_object(path: Path) -> dict:
    """A state file's object for a plot; absent or damaged ones draw nothing (the run names them when it reads
    them back)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


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
    evals, about = {}, {}
    data = _json_object(run_dir / "eval.json")  # the held-out headline number before / after, beside the reward
    if data:
        about = data.get("about", {})  # which number the evaluator headlines, and its title
        if about.get("headline"):
            evals = {k: v for k, v in data.items() if k in ("before", "after") and isinstance(v, dict)}
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
        best = _json_object(run_dir / "best.json")
        if best.get("ended_with"):  # the run ended with its best curve point's weights: "after" is drawn there
            where["after"], label = best["iteration"], f"full evaluation (after: iteration {best['iteration']}'s weights)"
        key, scale = about["headline"], about.get("scale", 1.0)
        points = [(where[k], scale * number(v[key])) for k, v in evals.items() if k in where and key in v]
        ax.plot([p[0] for p in points], [p[1] for p in points], "o-", color="C2", label=label)
        curve = read_metrics(run_dir / "eval_curve.jsonl")
        if curve:  # the periodic points use fewer seeds: noisier, drawn thinner
            unit = "videos" if "videos" in curve[0] else "images"
            ax.plot([c["iteration"] for c in curve], [scale * number(c.get(key)) for c in curve], ".--",
                    color="C4", lw=1,
                    label=f"every log.eval_every ({curve[0].get(unit, 0)} {unit})")
            ax.legend(fontsize=7)
        for x, y in points:
            ax.annotate(f"{y:.1f}{about.get('unit', '')}", (x, y), textcoords="offset points", xytext=(0, 6),
                        ha="center", fontsize=8)
        ax.margins(x=0.1, y=0.3)
        ax.set_title(about.get("title", f"held-out {key}"))
        ax.set_xlabel("iteration")
        ax.set_ylabel(about.get("unit", key))
        ax.grid(alpha=0.3)
    fig.suptitle(run_dir.name, fontsize=9)
    out = run_dir / "reward_curve.png"
    save_figure(fig, out)
    return out


def plot_guard(run_dir: Path, tolerances: dict | None = None) -> Path | None:
    """guard.png: the reward-hacking guard's signals at each check (metrics.jsonl's ``guard/...``), each beside its
    starting value (guard.json) and, given ``tolerances`` (the ``guard`` config as a dict), its trigger line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = run_dir / "guard.json"
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "guard/artifacts" in r]
    if not path.is_file() or not rows:
        return None
    start, tol = json.loads(path.read_text())["start"], tolerances or {}
    its = [0] + [r["iteration"] + 1 for r in rows]
    watched = sorted(start.get("watched", {}))
    panels = [("periodic artifacts (log power ratio)", ["artifacts"]), ("diversity", ["diversity"]),
              ("image drift", ["brightness", "saturation", "dark_fraction", "blown_fraction"])]
    if watched:
        panels.insert(0, ("watched rewards (minus their start)", watched))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.3 * len(panels), 3.3), squeeze=False)
    for ax, (title, keys) in zip(axes[0], panels):
        for i, key in enumerate(keys):
            if key in watched:
                s0 = start["watched"][key][0]
                ys = [0.0] + [r.get(f"guard/watched/{key}", float("nan")) - s0 for r in rows]
                if "watched_tolerance" in tol:
                    ax.axhline(-tol["watched_tolerance"] * start["watched"][key][1], color=f"C{i}", ls=":", lw=0.8)
            else:
                ys = [start[key]] + [r.get(f"guard/{key}", float("nan")) for r in rows]
                limit = {"artifacts": start[key] + tol.get("artifact_rise", float("nan")),
                         "diversity": start[key] * (1 - tol.get("diversity_drop", float("nan")))}.get(key)
                if limit is not None and limit == limit:
                    ax.axhline(limit, color="C3", ls=":", lw=0.8, label="trigger")
            ax.plot(its, ys, "o-", ms=3, color=f"C{i}", label=key.replace("_", " "))
        triggered = [r["iteration"] + 1 for r in rows if r.get("guard/triggered")]
        for x in triggered:
            ax.axvline(x, color="C3", alpha=0.3)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle(f"{run_dir.name}: reward-hacking guard (red bands: checks that triggered)", fontsize=9)
    out = run_dir / "guard.png"
    save_figure(fig, out)
    return out


def draw_plans(plans: list, path: str | Path, *, leaf_rewards: bool = True) -> Path:
    """Draw one prompt's denoising tree for each rollout plan, side by side: a node per state, x = the denoising
    index (sigma_0 = noise on the left), edges coloured by kind. SDE edges that are trained are solid red, SDE
    edges that are not trained orange, ODE edges grey; side branches (one SDE step, possibly merged over several
    indices, then ODE to the end) are drawn dashed.

    Args:
        plans: ``(title, plan)`` pairs; a plan needs ``steps`` (each with ``sde``, ``branch``, ``trained``,
            ``side``, ``side_merge``) and ``roots_per_prompt``, as :class:`flowrl.samplers.plans.RolloutPlan` has.
        path: the PNG to write.
        leaf_rewards: mark the leaves (the states that are decoded and scored) with a filled dot.
    Returns:
        The written path.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"trained": "#d62728", "sde": "#ff7f0e", "ode": "#9a9a9a"}
    fig, axes = plt.subplots(1, len(plans), figsize=(4.2 * len(plans), 3.6), squeeze=False)
    for ax, (title, plan) in zip(axes[0], plans):
        t = len(plan.steps)
        main = [float(r) for r in range(plan.roots_per_prompt)]  # y positions of the main line's live nodes
        side_lines = []
        for i, step in enumerate(plan.steps):
            kind = "trained" if step.trained else ("sde" if step.sde else "ode")
            children = []
            for y in main:
                for b in range(step.branch):  # children spread around the parent, narrower deeper in the tree
                    offset = (b - (step.branch - 1) / 2) * 2.0 ** (-i * 0.5) if step.branch > 1 else 0.0
                    children.append(y + offset)
                    ax.plot([i, i + 1], [y, y + offset], color=colours[kind], lw=1.6)
                for _ in range(step.side):  # a side jump, then its ODE completion to the end, each on its row
                    yy = -0.5 * (len(side_lines) + 1)
                    j = i + step.side_merge
                    ax.plot([i, j], [y, yy], color=colours["trained"], lw=1.3, ls="--")
                    if j < t:
                        ax.plot([j, t], [yy, yy], color=colours["ode"], lw=1.0, ls="--")
                    side_lines.append((t, yy))
            main = children
            ax.scatter([i + 1] * len(children), children, s=6, color="black", zorder=3)
        leaves = [(t, y) for y in main] + side_lines
        if leaf_rewards and leaves:
            ax.scatter(*zip(*leaves), s=22, color="#1f77b4", zorder=4)
        ax.scatter([0] * plan.roots_per_prompt, range(plan.roots_per_prompt), s=22, color="black", zorder=4)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("denoising index (noise -> image)")
        ax.set_yticks([])
        ax.set_xticks(range(t + 1))
    handles = [plt.Line2D([], [], color=colours["trained"], lw=2, label="SDE, trained"),
               plt.Line2D([], [], color=colours["sde"], lw=2, label="SDE, not trained"),
               plt.Line2D([], [], color=colours["ode"], lw=2, label="ODE"),
               plt.Line2D([], [], color=colours["trained"], lw=1.3, ls="--", label="side branch (jump, then ODE)"),
               plt.Line2D([], [], marker="o", color="#1f77b4", lw=0, label="leaf: decoded and scored")]
    fig.legend(handles=handles, loc="lower center", ncol=5, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    save_figure(fig, Path(path))
    return Path(path)
