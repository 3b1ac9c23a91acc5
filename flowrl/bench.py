"""``flowrl bench``: one measured iteration per phase, and the rollout batched vs ``max_batch=1``."""

from __future__ import annotations

import dataclasses
import random
import tempfile
import time

import torch

from .engine import rollout


def _time_rollout(trainer, plan, cond, max_batch: int, repeats: int) -> tuple[float, int]:
    cfg = trainer.cfg
    best, calls = float("inf"), 0
    for r in range(repeats):
        gen = torch.Generator().manual_seed(1234 + r)
        t0 = time.perf_counter()
        tree = rollout(trainer.adapter, cond, plan, trainer.sigmas, trainer.latent_shape, kernel=cfg.sampler.kernel,
                       noise_level=cfg.sampler.noise_level, generator=gen, max_batch=max_batch,
                       guidance_scale=cfg.sampler.guidance_scale, negative=trainer.negative)
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
        calls = tree.transformer_calls
    return best, calls


def run_bench(cfg, repeats: int = 1) -> dict:
    from .sampling import peak_memory_mb
    from .trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        cfg = dataclasses.replace(cfg, log=dataclasses.replace(cfg.log, output_dir=tmp, run_name="bench", progress=False))
        trainer = Trainer(cfg)
        trainer.iteration(0)  # warm-up (allocations, caches)
        row = trainer.iteration(1)
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
            "peak_memory_mb": round(peak_memory_mb(trainer.device), 1),
            "rollout_batched": {"max_batch": cfg.sampler.max_batch, "seconds": round(batched, 4), "transformer_calls": calls_b},
            "rollout_max_batch_1": {"max_batch": 1, "seconds": round(single, 4), "transformer_calls": calls_1},
            "speedup_batched_vs_1": round(single / batched, 2),
            "device": str(trainer.device),
            "threads": torch.get_num_threads(),
        }


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
        })
    return rows
