"""Callbacks: what happens around the training loop without being the loop.

The trainer calls every callback's hooks in order: :meth:`Callback.on_train_begin` (after the first sample grid
of a fresh run), :meth:`Callback.on_iteration_end` with the iteration's metrics row (a callback may return a reason
to stop early, as Hugging Face's ``EarlyStoppingCallback`` sets ``should_training_stop``), and
:meth:`Callback.on_train_end`. The shipped ones write the metrics rows, draw the reward curve, log to trackers
and run the held-out evaluation (curve points, best checkpoint, early stop and ending with the best weights,
like ``load_best_model_at_end``). A callback reads what it needs from the trainer it is given.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

from . import report
from .checkpoint import load_full_into, load_lora_into, save_checkpoint
from .editing import prepend_sources
from .errors import ConfigError, FlowRLError
from .guard import diversity, flat, image_drift, periodic_artifact_score, pixel_embeddings, violations


def save_named_weights(trainer, name: str, it: int, extra: dict) -> None:
    """The policy's current (EMA where enabled) weights in checkpoints/<name>, written by every process's shards when
    sharded, else by the main process; ``extra`` goes into the checkpoint's metadata."""
    p, folder = trainer.policy, trainer.run_dir / "checkpoints" / name
    if p.sharded:
        from .sharded_checkpoint import save_sharded_checkpoint

        with p.ema_weights():
            save_sharded_checkpoint(folder, p, trainer.adapter, trainer.procs, it, extra=extra)
    elif trainer.procs.is_main:
        with p.ema_weights():
            save_checkpoint(folder, trainer.adapter, p.module, p.optimizer, it, lora=p.lora, extra=extra,
                            keep=trainer.cfg.log.keep_checkpoints)


def load_named_weights(trainer, folder) -> None:
    """Weights saved by :func:`save_named_weights` become the policy's (the EMA reset to them), on every process."""
    trainer.procs.barrier()  # the main process has written the folder
    policy = trainer.policy
    if policy.sharded:
        from .sharded_checkpoint import load_sharded_weights

        load_sharded_weights(policy.module, folder)
    else:
        (load_lora_into if policy.lora else load_full_into)(policy.module, folder, trainer.cfg)
    policy.reset_ema()


class Callback:
    def on_train_begin(self, trainer) -> None:
        pass

    def on_iteration_end(self, trainer, it: int, row: dict) -> str | None:
        """After iteration ``it`` (its metrics ``row``); a string stops the run after this iteration."""
        return None

    def on_train_end(self, trainer) -> None:
        pass


class MetricsWriter(Callback):
    """metrics.jsonl: one row per iteration, flushed to disk (main process)."""

    def on_iteration_end(self, trainer, it, row):
        if trainer.procs.is_main:
            report.append_metrics(trainer.folder.metrics, row)


class RewardCurvePlot(Callback):
    """reward_curve.png, redrawn with the sample grids (after the first iteration, every ``log.sample_every``) and at
    the end, with the held-out panel where the run has one."""

    def on_iteration_end(self, trainer, it, row):
        every = trainer.cfg.log.sample_every
        if trainer.procs.is_main and (it == trainer.start_iteration or (every and (it + 1) % every == 0)):
            report.plot_reward_curve(trainer.run_dir)

    def on_train_end(self, trainer):
        if trainer.procs.is_main:
            report.plot_reward_curve(trainer.run_dir)


class NoSignalStop(Callback):
    """``log.stop_without_signal`` = N: when every group's rewards were equal (no spread, so zero advantages and
    nothing to learn) in N iterations in a row, the run stops with one line saying what to check; the metrics of
    those iterations are kept."""

    def __init__(self, iterations: int):
        self.iterations, self.flat = iterations, []

    def on_iteration_end(self, trainer, it, row):
        flat = row.get("zero_std_ratio") == 1.0 or row.get("reward_std/total") == 0.0
        self.flat = self.flat + [it] if flat else []
        if len(self.flat) >= self.iterations:
            raise FlowRLError(f"no learning signal: every group's rewards were equal in iterations {self.flat[0]}.."
                              f"{self.flat[-1]}, so nothing trained; check the rewards (their weights, and what they "
                              "score) and sampler.noise_level, or set log.stop_without_signal=0 to run on")
        return None


class BudgetStop(Callback):
    """``train.budget_evaluations`` / ``train.budget_seconds``: the run ends after the iteration that reaches its
    budget (``evaluations_cum``, ``seconds_cum``), with its checkpoint and final evaluation as at its last
    iteration, so methods are compared at equal compute."""

    def __init__(self, evaluations: int, seconds: float):
        self.evaluations, self.seconds = evaluations, seconds

    def on_iteration_end(self, trainer, it, row):
        if self.evaluations and row.get("evaluations_cum", 0) >= self.evaluations:
            return (f"budget reached: {row['evaluations_cum']:,} transformer evaluations of "
                    f"{self.evaluations:,} after iteration {it}")
        if self.seconds and row.get("seconds_cum", 0.0) >= self.seconds:
            return f"budget reached: {row['seconds_cum']:.0f} s of {self.seconds:.0f} after iteration {it}"
        return None


class TrackerLog(Callback):
    """The numeric fields of each row to accelerate's trackers (``log.trackers``: tensorboard, wandb)."""

    def on_iteration_end(self, trainer, it, row):
        trainer.accelerator.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=it)

    def on_train_end(self, trainer):
        trainer.accelerator.end_training()


def read_state_file(path, what: str, check=None, main: bool = True):
    """A state file a resumed run reads back (best.json, eval.json, guard.json): its JSON object, or None when it
    is absent. A damaged one (not JSON, not an object, or failing ``check``) is named in one warning line, moved
    aside to ``<name>.damaged`` by the main process (never silently replaced) and treated as absent."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        if check is not None:
            check(data)
        return data
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        if main:
            aside = path.with_name(path.name + ".damaged")
            os.replace(path, aside)
            print(f"warning: {path} is damaged ({str(exc)[:120]}); moved to {aside.name}, {what}", file=sys.stderr)
        return None


def _check_best(data: dict) -> None:
    if not isinstance(data.get("iteration"), int) or not isinstance(data.get("since"), int):
        raise ValueError("iteration and since must be whole numbers")
    if not isinstance(data.get("value"), (int, float)) or not math.isfinite(data["value"]):
        raise ValueError("value must be a finite number")
    if not isinstance(data.get("metric"), str):
        raise ValueError("metric must be a name")


class HeldOutMonitor(Callback):
    """The held-out evaluation (``log.eval``): the full evaluation before and after training (eval.json and the
    before | after grid); every ``log.eval_every`` iterations a curve point on the first ``log.eval_curve_seeds``
    seeds (eval_curve.jsonl); the best point's weights in checkpoints/best (``log.keep_best``); early stopping
    (``log.early_stop_patience`` points without a new best, or ``log.early_stop_drop`` below the best); and at the
    end, the best weights in place of the last ones where they beat them.

    Every process samples its share of the prompts; the main process's numbers decide and it writes the files.
    ``metric`` is the number watched: ``log.best_metric``, else the evaluator's ``headline``."""

    def __init__(self, evaluator, cfg):
        self.evaluator, self.log = evaluator, cfg.log
        self.metric = cfg.log.best_metric or getattr(evaluator, "headline", "")
        self.best: dict | None = None

    # ------------------------------------------------------------------------------------------ hooks
    def on_train_begin(self, trainer):
        # a resumed run's, on every process
        self.best = read_state_file(trainer.run_dir / "best.json", "the best point is chosen again from the next "
                                    "curve point", _check_best, trainer.procs.is_main)
        if trainer.start_iteration == 0:
            self.evaluate(trainer, "before")
            self.curve_point(trainer, 0)

    def on_iteration_end(self, trainer, it, row):
        every = self.log.eval_every
        if not every or not ((it + 1) % every == 0 or it == trainer.cfg.train.iterations - 1):
            return None
        stop = self.curve_point(trainer, it + 1)
        if stop:
            self.best["stopped_early"] = stop
            self._write_best(trainer)
        return stop

    def on_train_end(self, trainer):
        self.restore_best(trainer)
        if trainer.start_iteration < trainer.cfg.train.iterations:
            self.evaluate(trainer, "after")

    # ------------------------------------------------------------------------------------------ the work
    def evaluate(self, trainer, when: str) -> dict:
        """The full evaluation of the (EMA) policy into eval.json[when]; after training, the before | after grid."""
        with trainer.policy.ema_weights():
            result, grid, labels = self.evaluator(trainer.eval_sampler, self.log.eval_seeds, grid=True)
        if not trainer.procs.is_main:
            return result
        run_dir = trainer.run_dir
        path = run_dir / "eval.json"
        data = read_state_file(path, "and a new one is written") or {}
        data[when] = result
        data["about"] = {**getattr(self.evaluator, "about", {}), "headline": self.metric}  # what reports draw
        bad = sorted(k for k, v in result.items() if isinstance(v, float) and not math.isfinite(v))
        if bad:  # written as null: strict JSON readers refuse NaN, and no later step may take it for a number
            print(f"warning: the held-out evaluation ({when}) returned non-finite {', '.join(bad[:4])}; written as "
                  "null in eval.json", file=sys.stderr)
        report.atomic_write_bytes(path, json.dumps(report.finite_json(data), indent=1).encode())
        before_path = run_dir / "heldout_before.pt"
        if when == "before":
            torch.save(grid, before_path)
        elif before_path.is_file():
            try:
                before = torch.load(before_path, weights_only=True)
                if not isinstance(before, torch.Tensor) or before.shape[1:] != grid.shape[1:]:
                    raise ValueError(f"holds {type(before).__name__} {getattr(before, 'shape', '')}, not this grid")
            except Exception as exc:  # a cut or foreign file: the numbers stand, the picture is left out
                print(f"warning: {before_path} is damaged ({str(exc)[:120]}); no before_after.png this time",
                      file=sys.stderr)
                return result
            cols = grid.shape[0] // len(labels)
            title = "held-out prompts: left before | right after" + "".join(
                f"   {label} {data.get('before', {}).get(key, float('nan')):{fmt}} -> "
                f"{result.get(key, float('nan')):{fmt}}"
                for key, label, fmt in getattr(self.evaluator, "title_numbers", ()) if key in result)
            pair = report.side_by_side(before, grid, cols)
            shown = prepend_sources(pair, labels, 2 * cols)  # edit requests: source | before | after
            if shown is not pair:
                title = title.replace("held-out prompts: left before | right after", "held-out edits: source | before | after")
            report.save_grid(shown, shown.shape[0] // len(labels), run_dir / "before_after.png", row_labels=labels,
                             title=title)
        return result

    def curve_point(self, trainer, done: int) -> str | None:
        """One curve point after ``done`` iterations, with the work spent so far; a new best is kept. Returns why
        the run should stop early, else None."""
        log = self.log
        if not log.eval_every:
            return None
        start = time.perf_counter()
        with trainer.policy.ema_weights():
            result = self.evaluator(trainer.eval_sampler, log.eval_seeds[: log.eval_curve_seeds])
        result = trainer.procs.broadcast(result)  # the main process's numbers decide everywhere
        seconds = time.perf_counter() - start  # the curve's share of a run's wall time is read from these
        value = result.get(self.metric)
        if not isinstance(value, (int, float)):
            numbers = ", ".join(sorted(k for k, v in result.items() if isinstance(v, (int, float))))
            if not self.metric:
                raise ConfigError(f"log.best_metric: the {trainer.cfg.log.eval} evaluator names no headline number; "
                                  f"set log.best_metric to one of {numbers}")
            raise ConfigError(f"log.best_metric: the {trainer.cfg.log.eval} evaluator has no number "
                              f"{self.metric!r}; use one of {numbers}")
        finite = math.isfinite(value)
        if not finite:  # never a best: the point is kept (as null) and the trained weights stay
            print(f"warning: held-out {self.metric} is {value} at iteration {done}; not a best point, and the run "
                  "keeps its trained weights", file=sys.stderr)
        if not finite:
            if self.best is not None:
                self.best["since"] += 1
        elif self.best is None or value > self.best["value"]:
            self.best = {"iteration": done, "metric": self.metric, "value": value, "since": 0}
            if log.keep_best:  # the weights just evaluated (EMA where enabled)
                save_named_weights(trainer, "best", done - 1, {"best": self.best})
        else:
            self.best["since"] += 1
        best = self.best
        if best is not None:
            self._write_best(trainer)
        if trainer.procs.is_main:
            report.append_metrics(trainer.folder.curve,
                                  report.finite_json({"iteration": done, **trainer.work.counts, **result,
                                                      "seconds_curve_point": seconds}))
        name = self.metric
        if best is None or not finite:
            return None
        if log.early_stop_drop and best["value"] - value > log.early_stop_drop:
            return (f"stopping early at iteration {done}: held-out {name} {value:.4f} fell more than "
                    f"{log.early_stop_drop} below its best {best['value']:.4f} (iteration {best['iteration']})")
        if log.early_stop_patience and best["since"] >= log.early_stop_patience:
            return (f"stopping early at iteration {done}: no new best held-out {name} in {best['since']} curve points "
                    f"(best {best['value']:.4f} at iteration {best['iteration']})")
        return None

    def _write_best(self, trainer) -> None:
        if trainer.procs.is_main:
            report.atomic_write_bytes(trainer.run_dir / "best.json", json.dumps(self.best, indent=1).encode())

    def restore_best(self, trainer) -> None:
        """End the run with the best curve point's weights when they beat the last point's (``log.keep_best``):
        they become the policy (EMA reset to them) for the 'after' evaluation, and the run says so."""
        trainer.procs.barrier()  # the main process has written checkpoints/best
        best, ckpt = self.best, trainer.run_dir / "checkpoints" / "best"
        if not (self.log.keep_best and best and ckpt.is_dir()):
            return
        last = report.read_metrics(trainer.folder.curve)[-1]
        value = last.get(best["metric"])
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            return  # the last point is not a number: nothing says the earlier weights beat it; the trained ones stay
        if last["iteration"] == best["iteration"] or value >= best["value"]:
            return  # a last point that ties the best keeps the trained weights: the earlier ones do not beat it
        load_named_weights(trainer, ckpt)
        best["ended_with"] = True  # `--checkpoint RUN_DIR` (sample, eval, export) then means these weights
        self._write_best(trainer)
        if trainer.procs.is_main:
            print(f"the run ends with its best held-out weights: {best['metric']} {best['value']:.4f} at iteration "
                  f"{best['iteration']} (last point {last[best['metric']]:.4f} at iteration {last['iteration']}); they "
                  f"are in {ckpt}", file=sys.stderr)


class RewardHackingGuard(Callback):
    """``guard.*``: the start's measurement in guard.json (a resumed run keeps it), a check every ``guard.every``
    iterations (its numbers added to the metrics row), and the trigger's action. Runs before the metrics are written.
    Every process samples its share; the main process measures, and its verdict decides everywhere."""

    def __init__(self, cfg):
        self.g = cfg.guard
        self.start: dict | None = None
        self.embedder = None
        self.watched = None
        self.state: dict = {}

    # ---------------------------------------------------------------- hooks
    def on_train_begin(self, trainer):
        if trainer.cfg.train.iterations < self.g.every:  # no check would come: nothing to measure
            return
        path = trainer.run_dir / "guard.json"

        def check(data):
            if data.get("start") is not None and not isinstance(data["start"], dict):
                raise ValueError("start must be an object")
            if not isinstance(data.get("checks", []), list):
                raise ValueError("checks must be a list")

        self.state = read_state_file(path, "so the guard measures its start again, from the weights this run "
                                     "resumes with", check, trainer.procs.is_main) or {}
        self.start = self.state.get("start")
        if self.start is None:
            self.start = self.measure(trainer)
            self.state = {"start": self.start, "checks": [], "ok_iteration": 0}
            if self.g.on_trigger == "restore_best":
                save_named_weights(trainer, "guard_ok", 0, {"guard_ok": 0})
            self._write(trainer)

    def on_iteration_end(self, trainer, it, row):
        if self.start is None or (it + 1) % self.g.every:
            return None
        t0 = time.perf_counter()
        now = self.measure(trainer)
        problems = violations(now, self.start, self.g)
        row.update(flat(now))
        row["guard/triggered"] = len(problems)
        row["guard/seconds"] = time.perf_counter() - t0
        self.state.setdefault("checks", []).append({"iteration": it + 1, "problems": problems})
        if not problems:
            self.state["ok_iteration"] = it + 1
            if self.g.on_trigger == "restore_best":
                save_named_weights(trainer, "guard_ok", it, {"guard_ok": it + 1})
            self._write(trainer)
            return None
        self._write(trainer)
        message = f"reward-hacking guard at iteration {it + 1}: {'; '.join(problems)}"
        if self.g.on_trigger == "warn":
            if trainer.procs.is_main:
                print(message + " (guard.on_trigger=warn: the run goes on)", file=sys.stderr)
            return None
        if self.g.on_trigger == "restore_best":
            folder, done, which = self.restore_point(trainer)
            load_named_weights(trainer, folder)
            self.state["restored"] = done
            self._write(trainer)
            return f"{message}; the run ends with the weights of iteration {done}, {which}"
        return message

    def restore_point(self, trainer) -> tuple:
        """(folder, iteration, why) of the weights a trigger restores: the held-out evaluation's best point where it
        comes no later than the last check at which every signal held (weights both validated and unhacked), else
        that check's weights."""
        ok, run = self.state.get("ok_iteration", 0), trainer.run_dir
        monitor = next((c for c in trainer.callbacks if isinstance(c, HeldOutMonitor)), None)
        best = monitor.best if monitor is not None else None
        if best and trainer.cfg.log.keep_best and best["iteration"] <= ok and (run / "checkpoints" / "best").is_dir():
            return (run / "checkpoints" / "best", best["iteration"],
                    f"the best held-out point ({best['metric']} {best['value']:.4f}) at or before iteration {ok}, the "
                    f"last check at which every signal held")
        return run / "checkpoints" / "guard_ok", ok, "the last check at which every signal held"

    # ---------------------------------------------------------------- the measurement
    def prompts(self, trainer) -> list[str]:
        if self.g.prompts:
            return list(self.g.prompts)
        if self.g.prompt_set:
            from .prompts import prompt_set

            return prompt_set(self.g.prompt_set, "guard.prompt_set")[: self.g.num_prompts]
        return trainer.prompts.prompts[: self.g.num_prompts]

    def measure(self, trainer) -> dict:
        """Every signal on the guard's samples of the current (EMA) weights."""
        prompts, seeds = self.prompts(trainer), list(self.g.seeds)
        with trainer.policy.ema_weights():
            images = trainer.eval_sampler(prompts, seeds)  # (P * S, 3, H, W) or (P * S, F, 3, H, W), prompt-major
        result = None
        if trainer.procs.is_main:
            period = trainer.adapter.patch_pixels(trainer.cfg.model.resolution)
            result = {"period": period, "artifacts": periodic_artifact_score(images, period),
                      "diversity": diversity(self.embed(images), len(prompts)), **image_drift(images),
                      "watched": self.score_watched(images, prompts, seeds)}
        return trainer.procs.broadcast(result)

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        if not self.g.diversity_embedder:
            return pixel_embeddings(images)
        if self.embedder is None:
            from .rewards.embedding import image_embedder

            self.embedder = image_embedder(self.g.diversity_embedder)
        return F.normalize(self.embedder(images), dim=-1)

    def score_watched(self, images, prompts: list[str], seeds: list[int]) -> dict[str, tuple[float, float]]:
        if not self.g.watched:
            return {}
        if self.watched is None:
            from .rewards import build_reward_set

            self.watched = build_reward_set(self.g.watched)
        per_image = [p for p in prompts for _ in seeds]
        scores = self.watched(images, per_image, [{} for _ in per_image])
        out = {}
        for name, values in scores.components.items():
            v = values[torch.isfinite(values)].double()
            # (mean, standard error of the mean)
            out[name] = (float(v.mean()) if len(v) else float("nan"),
                         float(v.std(correction=1)) / len(v) ** 0.5 if len(v) > 1 else 0.0)
        return out

    def _write(self, trainer) -> None:
        if trainer.procs.is_main:
            report.atomic_write_bytes(trainer.run_dir / "guard.json", json.dumps(self.state, indent=1).encode())

    def on_train_end(self, trainer):
        if self.start is not None and trainer.procs.is_main:
            report.plot_guard(trainer.run_dir, self.g.model_dump())


def built_in_callbacks(cfg, evaluator) -> list[Callback]:
    """The callbacks every run has, in order: the reward-hacking guard (``guard.enabled``: it adds its numbers to the
    row, so it runs first), metrics rows, the held-out evaluation (when ``evaluator``), the reward curve, trackers
    (``log.trackers``) and the no-signal stop (``log.stop_without_signal``)."""
    return ([RewardHackingGuard(cfg)] if cfg.guard.enabled else []) + ([MetricsWriter()] + ([HeldOutMonitor(evaluator, cfg)] if evaluator is not None else [])
            + [RewardCurvePlot()] + ([TrackerLog()] if cfg.log.trackers else [])
            + ([NoSignalStop(cfg.log.stop_without_signal)] if cfg.log.stop_without_signal else [])
            + ([BudgetStop(cfg.train.budget_evaluations, cfg.train.budget_seconds)]
               if cfg.train.budget_evaluations or cfg.train.budget_seconds else []))
