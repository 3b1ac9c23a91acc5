"""A ranked-table plan: every label (a preset and its overrides) trained with every seed on one protocol, then
ranked (:func:`flowrl.report.runs.rank_runs`) and drawn (:func:`flowrl.report.runs.compare_runs`).

The plan is a YAML file::

    protocol: [train.iterations=60, ...]   # overrides every run gets
    seeds: [0, 1, 2]
    baseline: flat                           # the label the others are compared with
    jobs: 2                                  # runs at a time, one CPU thread each
    labels:
      flat: {config: configs/tiny_default.yaml, overrides: [...]}
      opd: {config: ..., overrides: ["algorithm.teacher={run:lowpass:0}"]}   # another run's folder

Runs land in ``OUT/<label>-s<seed>``; a finished one (its eval.json has "after") is kept, so an interrupted plan
continues where it stopped; an unfinished one is started again from scratch. A run that names another with
``{run:LABEL:SEED}`` waits for it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from .files import run_being_written

RUN_REF = re.compile(r"\{run:([\w.-]+):(\d+)\}")


@dataclass
class PlannedRun:
    label: str
    seed: int
    config: str
    overrides: list[str]

    @property
    def name(self) -> str:
        return f"{self.label}-s{self.seed}"

    def needs(self) -> set[str]:
        return {f"{lab}-s{seed}" for o in self.overrides for lab, seed in RUN_REF.findall(o)}


def read_plan(path: Path) -> tuple[dict, list[PlannedRun]]:
    """The plan's settings and its runs, dependencies first; one-line errors for what is missing."""
    import yaml

    from ..config import SEED_MAX
    from ..resources import find_config

    found = find_config(path)  # a file, or the shipped plan of that name (configs/benchmarks/ranked.yaml)
    if found is None:
        raise ConfigError(f"{path}: no such plan file")
    path = found
    plan = yaml.safe_load(path.read_text()) or {}
    for key in ("protocol", "seeds", "labels"):
        if key not in plan:
            raise ConfigError(f"{path}: the plan needs '{key}'")
    runs = []
    for label, spec in plan["labels"].items():
        if "config" not in spec:
            raise ConfigError(f"{path}: label {label!r} needs a config")
        config = find_config(spec["config"])  # as given, or the shipped preset of that name
        if config is None:
            raise ConfigError(f"{path}: label {label!r}: no config {spec['config']}")
        for seed in spec.get("seeds", plan["seeds"]):
            if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
                raise ConfigError(f"{path}: label {label!r}: seed {seed!r} is not a whole number in 0..{SEED_MAX} "
                                  "(train.seed's range)")
            runs.append(PlannedRun(label, seed, str(config), list(spec.get("overrides", []))))
    names = {r.name for r in runs}
    for r in runs:
        missing = r.needs() - names
        if missing:
            raise ConfigError(f"{path}: {r.name} names {sorted(missing)[0]}, which the plan does not run")
    ordered: list[PlannedRun] = []  # the plan's order, each run after the runs it names
    while runs:
        ready = next(r for r in runs if r.needs() <= {o.name for o in ordered})
        ordered.append(ready)
        runs.remove(ready)
    runs = ordered
    if plan.get("baseline") and plan["baseline"] not in plan["labels"]:
        raise ConfigError(f"{path}: baseline {plan['baseline']!r} is none of the labels")
    return plan, runs


def finished(run_dir: Path) -> bool:
    import json

    path = run_dir / "eval.json"
    return path.is_file() and "after" in json.loads(path.read_text())


def claim_folder(out: Path, name: str) -> str:
    """Just before a plan run starts, what its folder holds now (another plan may share ``out``): ``finished`` (left
    as it is), ``busy`` (another live process writes it: left to it), or ``ready`` (absent; an unfinished folder
    from an interrupted plan, which no process writes, is moved to ``out/logs/interrupted/`` first, never
    deleted)."""
    folder = out / name
    if finished(folder):
        return "finished"
    if run_being_written(folder):
        return "busy"
    if folder.exists():
        aside = out / "logs" / "interrupted" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        aside.parent.mkdir(parents=True, exist_ok=True)
        folder.rename(aside)
    return "ready"


def run_plan(plan_path: Path, out: Path, jobs: int | None = None, only: list[str] | None = None,
             progress: bool = True) -> list[Path]:
    """Train every missing run of the plan (``only``: these labels), ``jobs`` at a time, each its own process
    with one CPU thread and its output in ``OUT/logs``. Returns the finished run folders of the plan."""
    from tqdm import tqdm

    plan, runs = read_plan(plan_path)
    if only:
        unknown = sorted(set(only) - set(plan["labels"]))
        if unknown:
            raise ConfigError(f"--labels: {unknown[0]!r} is none of the plan's labels")
        runs = [r for r in runs if r.label in only]
    jobs = jobs or int(plan.get("jobs", 1))
    out = Path(out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    todo = [r for r in runs if not finished(out / r.name)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    running: dict[str, tuple[subprocess.Popen, float]] = {}
    failed = []
    bar = tqdm(total=len(todo), desc="ranked runs", disable=not progress)
    while todo or running:
        for name, (proc, _) in list(running.items()):
            if proc.poll() is not None:
                del running[name]
                bar.update(1)
                if proc.returncode != 0 or not finished(out / name):
                    failed.append(name)
        ready = [r for r in todo if not (r.needs() & ({t.name for t in todo} | set(running) | set(failed)))]
        blocked = [r for r in todo if r.needs() & set(failed)]
        for r in blocked:  # what it waits for failed: it fails too
            todo.remove(r)
            failed.append(r.name)
            bar.update(1)
        while ready and len(running) < jobs:
            r = ready.pop(0)
            todo.remove(r)
            state = claim_folder(out, r.name)  # decided now: the plan's first look may be hours old
            if state != "ready":
                bar.update(1)
                if state == "busy":
                    print(f"{r.name}: another process is training it; left to it", file=sys.stderr)
                continue
            overrides = [RUN_REF.sub(lambda m: str(out / f"{m.group(1)}-s{m.group(2)}"), o) for o in r.overrides]
            cmd = [sys.executable, "-m", "flowrl", "train", r.config, *plan["protocol"], *overrides,
                   f"train.seed={r.seed}", f"log.output_dir={out}", f"log.run_name={r.name}", "log.progress=false"]
            log = open(out / "logs" / f"{r.name}.log", "w")
            log.write(" ".join(cmd) + "\n")
            log.flush()
            running[r.name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), time.time())
            bar.set_postfix(running=",".join(running))
        time.sleep(1.0)
    bar.close()
    if failed:
        print(f"failed: {', '.join(failed)} (see {out / 'logs'})", file=sys.stderr)
    return [out / r.name for r in runs if finished(out / r.name)]
