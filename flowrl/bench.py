"""``flowrl bench``: one measured iteration per phase, and the rollout batched vs ``max_batch=1``."""

from __future__ import annotations

import random
import tempfile
import time

import torch

from .engine import rollout
from .sampling import synchronize


def _time_rollout(trainer, plan, cond, max_batch: int, repeats: int) -> tuple[float, int]:
    cfg = trainer.cfg
    best, calls = float("inf"), 0
    for r in range(repeats):
        gen = torch.Generator().manual_seed(1234 + r)
        t0 = time.perf_counter()
        tree = rollout(trainer.adapter, cond, plan, trainer.sigmas, trainer.latent_shape, kernel=cfg.sampler.kernel,
                       noise_level=cfg.sampler.noise_level, generator=gen, max_batch=max_batch,
                       guidance_scale=cfg.sampler.guidance_scale, negative=trainer.negative)
        synchronize(trainer.device)
        best = min(best, time.perf_counter() - t0)
        calls = tree.transformer_calls
    return best, calls


class TransformerClock:
    """Seconds spent inside the transformer during a block: its forwards (hooks on the module) and the backward
    passes (``accelerator.backward``, which on these models is the transformer's backward plus a few element-wise
    ops). On CUDA each boundary synchronises, so the clock is for benchmarks, not for training runs."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.forward = self.backward = 0.0
        self.forward_calls = 0
        self.forward_by_phase: dict[str, float] = {}  # by the FLOP meter's phase (rollout, update; None outside)

    def _sync(self):
        synchronize(self.trainer.device)

    def __enter__(self):
        module = self.trainer.policy.module
        starts = []

        def pre(mod, args):
            self._sync()
            starts.append(time.perf_counter())

        def post(mod, args, out):
            self._sync()
            seconds = time.perf_counter() - starts.pop()
            self.forward += seconds
            self.forward_calls += 1
            phase = self.trainer.meter.current
            self.forward_by_phase[phase] = self.forward_by_phase.get(phase, 0.0) + seconds

        # every transformer an iteration calls: the trained one, full fine-tuning's frozen KL reference, and the
        # family's other transformers (a frozen expert that draws the steps on the other side of a boundary): their
        # time is transformer time too, not engine overhead
        others = [self.trainer.policy.frozen, *self.trainer.adapter.extra_transformers()]
        modules = [module] + [m for m in others if m is not None]
        self._handles = [h for m in modules for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
        accelerator = self.trainer.accelerator
        self._backward = accelerator.backward

        def timed_backward(loss, **kwargs):
            self._sync()
            t0 = time.perf_counter()
            self._backward(loss, **kwargs)
            self._sync()
            self.backward += time.perf_counter() - t0

        accelerator.backward = timed_backward
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self.trainer.accelerator.backward = self._backward

    @property
    def seconds(self) -> float:
        return self.forward + self.backward


def run_bench(cfg, repeats: int = 1) -> dict:
    from .sampling import peak_memory_mb
    from .trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        cfg = cfg.model_copy(update={"log": cfg.log.model_copy(update={"output_dir": tmp, "run_name": "bench",
                                                                       "progress": False})})
        trainer = Trainer(cfg)
        trainer.iteration(0)  # warm-up (allocations, caches)
        with TransformerClock(trainer) as clock:
            t0 = time.perf_counter()
            row = trainer.iteration(1)
            wall = time.perf_counter() - t0
        plan = trainer.algorithm.plan(1, random.Random(0), trainer.sigmas)
        prompts, _ = trainer.prompts.batch(1, cfg.train.prompts_per_iter)
        cond = trainer.adapter.encode_prompts(prompts)
        batched, calls_b = _time_rollout(trainer, plan, cond, cfg.sampler.max_batch, repeats)
        single, calls_1 = _time_rollout(trainer, plan, cond, 1, repeats)
        leaves = plan.leaves_per_prompt * len(prompts)
        return {
            "algorithm": cfg.algorithm.name,
            "plan": plan.describe(),
            "prompts": len(prompts),
            "leaves": leaves,
            **plan.accounting(),
            "nfe_rollout": row["nfe_rollout"],
            "nfe_train": row["nfe_train"],
            "trained_edges": row["trained_edges"],
            "trained_edges_per_leaf_measured": row["trained_edges"] / leaves,
            "seconds_rollout": round(row["seconds_rollout"], 4),
            "seconds_reward": round(row["seconds_reward"], 4),
            "seconds_train": round(row["seconds_train"], 4),
            "seconds_iteration": round(row["seconds_rollout"] + row["seconds_reward"] + row["seconds_train"], 4),
            # the whole iteration (prompt encoding, rollout, decode, reward, advantages, update, logging) against the
            # time inside the transformer's forwards and backwards: what the engine around the model costs
            "seconds_iteration_wall": round(wall, 4),
            "seconds_transformer": round(clock.seconds, 4),
            "seconds_transformer_forward": round(clock.forward, 4),
            "seconds_transformer_backward": round(clock.backward, 4),
            "transformer_forward_calls": clock.forward_calls,
            "iteration_vs_transformer": round(wall / max(clock.seconds, 1e-9), 3),
            **{k: round(v, 4) for k, v in outside_shares(row, clock).items()},
            # under accelerate launch every process rolls out its share of the leaves
            "processes": trainer.procs.processes,
            # sharded (train.fsdp): zero-weight work that kept the processes' transformer calls in step
            **({"padding_calls_rollout": row.get("padding_calls_rollout", 0),
                "padding_micro_batches": row.get("padding_micro_batches", 0)} if cfg.train.fsdp.enabled else {}),
            # model FLOPs, TFLOP/s, MFU (with a known peak) and images/s per process, by phase (flowrl/throughput.py)
            **{k: v for k, v in row.items() if k.startswith(("flops_", "tflops_", "mfu_", "peak_tflops",
                                                             "images_per_second_per_process_"))},
            "memory_per_process_mb": {k.split("/")[1]: round(v, 3) for k, v in row.items() if k.startswith("memory/")},
            "images_per_second": round(row["leaves"] / wall, 3),
            "images_per_second_per_process": round(row["leaves"] / wall / trainer.procs.processes, 3),
            "peak_memory_mb": round(peak_memory_mb(trainer.device), 1),
            "rollout_batched": {"max_batch": cfg.sampler.max_batch, "seconds": round(batched, 4), "transformer_calls": calls_b},
            "rollout_max_batch_1": {"max_batch": 1, "seconds": round(single, 4), "transformer_calls": calls_1},
            "speedup_batched_vs_1": round(single / batched, 2),
            "device": str(trainer.device),
            "threads": torch.get_num_threads(),
        }


def outside_shares(row: dict, clock: TransformerClock) -> dict:
    """The share of each phase's time spent outside the transformer (the engine, SDE maths, decode, rewards,
    optimizer): what a regression of the code around the model shows in, without a device."""
    rollout, update = row["seconds_rollout"], row["seconds_train"]
    inside_update = clock.forward_by_phase.get("update", 0.0) + clock.backward
    return {"outside_transformer_share_rollout": max(0.0, 1 - clock.forward_by_phase.get("rollout", 0.0) / rollout),
            "outside_transformer_share_update": max(0.0, 1 - inside_update / update) if update > 0 else 0.0}


def _spread(values: list[float]) -> dict:
    import statistics

    med = statistics.median(values)
    return {"median": med, "min": min(values), "max": max(values),
            "spread": (max(values) - min(values)) / med if med > 0 else 0.0}


def alternate(cfgs: list, names: list[str], rounds: int = 3, unreliable_above: float = 0.2) -> dict:
    """Time the configs in turns, one measured iteration each per round (A B C A B C ...), so that a change of the
    machine's load between configs lands on all of them: per config the median and spread (max - min over median)
    of the iteration, rollout and update times and the outside-the-transformer shares; per config and phase the
    ratio of medians to the first config, with the range its extremes allow, marked unreliable when that range is
    wider than ``unreliable_above`` of the ratio."""
    from contextlib import ExitStack

    from .trainer import Trainer

    with ExitStack() as stack:
        trainers = []
        for cfg in cfgs:
            tmp = stack.enter_context(tempfile.TemporaryDirectory())
            cfg = cfg.model_copy(update={"log": cfg.log.model_copy(update={
                "output_dir": tmp, "run_name": "bench", "progress": False, "sample_every": 0, "save_every": 0,
                "eval": "none", "eval_every": 0})})
            trainer = Trainer(cfg)
            trainer.iteration(0)  # warm-up (allocations, caches)
            trainers.append(trainer)
        samples = {n: {k: [] for k in ("iteration", "rollout", "update", "outside_rollout", "outside_update")}
                   for n in names}
        order = []
        for r in range(rounds):
            for name, trainer in zip(names, trainers):
                with TransformerClock(trainer) as clock:
                    t0 = time.perf_counter()
                    row = trainer.iteration(1 + r)
                    wall = time.perf_counter() - t0
                shares = outside_shares(row, clock)
                s = samples[name]
                s["iteration"].append(wall)
                s["rollout"].append(row["seconds_rollout"])
                s["update"].append(row["seconds_train"])
                s["outside_rollout"].append(shares["outside_transformer_share_rollout"])
                s["outside_update"].append(shares["outside_transformer_share_update"])
                order.append(name)
    summary = {n: {k: _spread(v) for k, v in samples[n].items()} for n in names}
    first = summary[names[0]]
    ratios = {}
    for n in names:
        ratios[n] = {}
        for phase in ("iteration", "rollout", "update"):
            a, b = summary[n][phase], first[phase]
            ratio = a["median"] / b["median"] if b["median"] > 0 else float("nan")
            low = a["min"] / b["max"] if b["max"] > 0 else float("nan")
            high = a["max"] / b["min"] if b["min"] > 0 else float("nan")
            ratios[n][phase] = {"ratio": ratio, "low": low, "high": high,
                                "reliable": bool(ratio > 0 and (high - low) / ratio <= unreliable_above)}
    return {"rounds": rounds, "order": order, "per_config": summary, "ratios_vs_first": ratios,
            "note": f"a ratio is marked unreliable when the range its samples allow is wider than "
                    f"{unreliable_above:.0%} of it; rerun with more --rounds or on a quieter machine"}


def compare_table(results: list[dict]) -> list[dict]:
    """One row per config with the measured times, the plan's accounting and ratios to the first config."""
    base = results[0]
    rows = []
    for r in results:
        rows.append({
            "config": r["config"], "algorithm": r["algorithm"], "leaves_per_prompt": r["leaves_per_prompt"],
            "nfe_rollout_per_leaf": round(r["nfe_rollout_per_leaf"], 3),
            "trained_edges_per_leaf": round(r["trained_edges_per_leaf_measured"], 3),
            "seconds_iteration": r["seconds_iteration"],
            "iteration_time_vs_first": round(r["seconds_iteration"] / base["seconds_iteration"], 3),
            "rollout_time_vs_first": round(r["seconds_rollout"] / base["seconds_rollout"], 3),
            "train_time_vs_first": round(r["seconds_train"] / max(base["seconds_train"], 1e-9), 3),
            "rollout_speedup_batched_vs_1": r["speedup_batched_vs_1"],
            "iteration_vs_transformer": r["iteration_vs_transformer"],
        })
    return rows


def resident_mb() -> float:
    """This process's resident set size in MiB (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as fh:
            pages = int(fh.read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0.0
    import os

    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _malloc_trim() -> bool:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim); False where there is no glibc."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)  # returns 1 if it freed any
        return True
    except (OSError, AttributeError):
        return False


def _slope(rss: list[float], iterations: int) -> tuple[float, float]:
    """Least-squares slope of the second half and its standard error, in MiB per 100 iterations."""
    import numpy as np

    x = np.arange(iterations // 2, iterations)
    y = np.array(rss[iterations // 2:])
    slope, intercept = np.polyfit(x, y, 1)
    resid = y - (slope * x + intercept)
    stderr = float(np.sqrt((resid**2).sum() / max(len(x) - 2, 1) / ((x - x.mean()) ** 2).sum())) if len(x) > 2 else 0.0
    return round(float(slope) * 100, 3), round(stderr * 100, 3)


def memory_growth(cfg, iterations: int = 300, progress: bool = True) -> dict:
    """Train ``iterations`` iterations in a temporary run folder, recording the RSS after each, and fit a line to
    the second half (the first holds allocator warm-up): a leak shows as a positive slope in MiB per 100
    iterations well above the fit's noise. The RSS is read twice per iteration, as the allocator left it and
    after ``malloc_trim`` has returned the C heap's free pages: memory the allocator keeps but the program no
    longer holds grows only the first series; a leak grows both."""
    from tqdm.auto import tqdm

    from .trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        cfg = cfg.model_copy(update={
            "log": cfg.log.model_copy(update={"output_dir": tmp, "run_name": "memory", "sample_every": 0, "save_every": 0,
                                              "eval": "none", "eval_every": 0, "progress": False}),
            "train": cfg.train.model_copy(update={"iterations": iterations})})
        trainer = Trainer(cfg)
        rss, trimmed, can_trim = [], [], True
        for it in tqdm(range(iterations), desc="memory", disable=not progress):
            trainer.iteration(it)
            rss.append(resident_mb())
            can_trim = can_trim and _malloc_trim()
            trimmed.append(resident_mb())
    slope, stderr = _slope(rss, iterations)
    out = {"iterations": iterations, "rss_mb_first": round(rss[0], 1), "rss_mb_middle": round(rss[iterations // 2], 1),
           "rss_mb_last": round(rss[-1], 1), "rss_slope_mb_per_100_iterations": slope,
           "slope_stderr_mb_per_100_iterations": stderr}
    if can_trim:
        t_slope, t_stderr = _slope(trimmed, iterations)
        out.update({"rss_trimmed_mb_last": round(trimmed[-1], 1), "rss_trimmed_slope_mb_per_100_iterations": t_slope,
                    "trimmed_slope_stderr_mb_per_100_iterations": t_stderr})
    return out


def _settings(trainer) -> dict:
    """The CPU settings ``--profile`` compares, each a context that applies it for one rollout (None: left out)."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    @contextlib.contextmanager
    def setting(read, write, value):  # a process-wide torch setting for the duration
        old = read()
        write(value)
        try:
            yield
        finally:
            write(old)

    n = torch.get_num_threads()
    return {
        f"as configured ({n} threads, fp32)": contextlib.nullcontext,
        "one thread": (lambda: setting(torch.get_num_threads, torch.set_num_threads, 1)) if n > 1 else None,
        "fp32 matmul precision 'medium' (bf16 inside)": lambda: setting(
            torch.get_float32_matmul_precision, torch.set_float32_matmul_precision, "medium"),
        "bf16 autocast": lambda: torch.autocast(trainer.device.type, dtype=torch.bfloat16),
        "SDPA math kernel only": lambda: sdpa_kernel([SDPBackend.MATH]),
    }


def profile_rollout(cfg, rounds: int = 3, compile_blocks: bool = True) -> dict:
    """``flowrl bench --profile``: the config's rollout (one iteration's plan and prompts) under each setting of
    :func:`_settings`, taken in turns; per setting the median seconds, the ratio to the configured run and the largest
    difference in the final latents (how far the setting moves what the rewards see). With ``compile_blocks``, last,
    ``train.compile_transformer``'s compiled blocks: the first rollout's seconds (compilation included), then the
    steady state."""
    import statistics
    import types

    from .policy import configure_update_path
    from .trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        cfg = cfg.model_copy(update={"log": cfg.log.model_copy(update={"output_dir": tmp, "run_name": "profile",
                                                                       "progress": False})})
        trainer = Trainer(cfg)
        plan = trainer.algorithm.plan(0, random.Random(0), trainer.sigmas)
        prompts, _ = trainer.prompts.batch(0, cfg.train.prompts_per_iter)
        cond = trainer.adapter.encode_prompts(prompts)

        def one() -> tuple[float, torch.Tensor]:
            gen = torch.Generator().manual_seed(1234)
            t0 = time.perf_counter()
            with torch.no_grad():
                tree = rollout(trainer.adapter, cond, plan, trainer.sigmas, trainer.latent_shape,
                               kernel=cfg.sampler.kernel, noise_level=cfg.sampler.noise_level, generator=gen,
                               max_batch=cfg.sampler.max_batch, guidance_scale=cfg.sampler.guidance_scale,
                               negative=trainer.negative)
            synchronize(trainer.device)
            return time.perf_counter() - t0, tree.leaves.float()

        _, reference = one()  # also the warm-up
        settings = {k: v for k, v in _settings(trainer).items() if v is not None}
        seconds: dict[str, list[float]] = {k: [] for k in settings}
        moved: dict[str, float] = {}
        for _ in range(rounds):
            for name, apply in settings.items():
                with apply():
                    s, leaves = one()
                seconds[name].append(s)
                moved[name] = float((leaves - reference).abs().max())
        base = statistics.median(next(iter(seconds.values())))
        rows = [{"setting": k, "seconds": round(statistics.median(v), 4),
                 "speed_vs_configured": round(base / statistics.median(v), 3), "max_abs_latent_change": moved[k]}
                for k, v in seconds.items()]
        if compile_blocks:
            configure_update_path(trainer.adapter.transformer, types.SimpleNamespace(
                gradient_checkpointing=False, attention_backend=cfg.train.attention_backend, compile_transformer=True))
            first, _ = one()
            steady = [one() for _ in range(rounds)]
            rows.append({"setting": "train.compile_transformer (compiled blocks)",
                         "seconds": round(statistics.median(s for s, _ in steady), 4),
                         "speed_vs_configured": round(base / statistics.median(s for s, _ in steady), 3),
                         "max_abs_latent_change": float((steady[-1][1] - reference).abs().max()),
                         "first_rollout_seconds_with_compilation": round(first, 2)})
        return {"plan": plan.describe(), "device": str(trainer.device), "threads": torch.get_num_threads(),
                "rounds": rounds, "settings": rows}
