"""``flowrl gpu-check --plan``: what a CPU cannot execute of the GPU check, planned against a named card.

It reads the check's stages (``gpu_check.BENCH``, ``STAGES``) and the bench's own batch selection and FLOP-counting
rule (``gpu_bench.auto_batch``, ``flop_count_edges``), so the same file planned against an older check names that
check's failing case."""

from __future__ import annotations

import json


CARDS = {"H100 80GB": 79 * 2 ** 30, "H200": 139 * 2 ** 30, "A100 80GB": 79 * 2 ** 30, "A100 40GB": 39 * 2 ** 30}
PLAN_MARGIN = 0.9  # a case fits when its predicted peak is at most this share of the card


def plan_check(card: str = "H100 80GB", tiny: bool = False, stages: list[str] | None = None, emit=print) -> dict:
    """What a CPU cannot execute, planned: for every benchmark stage's family, resolution and update case, the
    micro-batch the real run picks (the same batch-selection code), the predicted peak of the timed step and of
    the FLOP-counting step beside the card; every stage's rollout plans built; the budgets summed. Returns the
    plan with ``problems`` (empty when everything fits)."""
    import torch

    from . import gpu_bench, gpu_check
    from .errors import ConfigError
    from .gpu_bench import UPDATE_CASES, auto_batch, rollout_plan
    from .gpu_check import BENCH, STAGES

    most = getattr(gpu_check, "MOST_BATCH", 16)  # the largest micro-batch a stage times
    # how many edges the FLOP-counting step holds at a timed batch: the bench's own rule, or (code that does not
    # state it) the timed batch itself without checkpointing, the conservative reading
    counted_edges = getattr(gpu_bench, "flop_count_edges", lambda batch: batch)

    capacity = CARDS[card]
    cpu = torch.device("cpu")
    rows, problems = [], []
    for name in stages or list(STAGES):
        if name not in BENCH:
            continue
        family, sizes = BENCH[name]
        for px, (steps, chains) in sizes.items():  # the real run's rollout plans, built (cheap) even for --tiny
            for tree in (False, True):
                try:
                    rollout_plan(tree, steps, chains)
                except ValueError as exc:
                    problems.append(f"{name}: the {'tree' if tree else 'flat'} rollout at {px} px: {exc}")
        if tiny:
            sizes = {32: (4, 4)}
        for px, (steps, chains) in sizes.items():
            for case in ("update", "update checkpointing"):
                ckpt = UPDATE_CASES[case][1]
                try:
                    batch, why = auto_batch(family, px, cpu, ckpt, most, capacity)
                except ConfigError as exc:  # not even one edge fits the card
                    problems.append(f"{name}: {case} at {px} px: {exc}")
                    continue
                timed = why["state_gib"] + batch * why["activations_per_input_gib"]
                # the FLOPs are counted without checkpointing, on as many edges as the bench's rule says
                plain = auto_batch(family, px, cpu, False, most, capacity)[1]
                counting = plain["state_gib"] + counted_edges(batch) * plain["activations_per_input_gib"]
                peak = max(timed, counting)
                row = {"stage": name, "family": family, "px": px, "case": case, "batch": batch,
                       "timed_step_gib": round(timed, 1), "flop_count_step_gib": round(counting, 1),
                       "card_gib": round(capacity / 2 ** 30, 1), "share": round(peak * 2 ** 30 / capacity, 3)}
                rows.append(row)
                emit(json.dumps(row))
                if peak * 2 ** 30 > PLAN_MARGIN * capacity:
                    problems.append(f"{name}: {case} at {px} px, batch {batch}: predicted peak {peak:.1f} GiB of "
                                    f"{capacity / 2 ** 30:.0f} GiB ({PLAN_MARGIN:.0%} allowed)")
    total = sum(STAGES[s] for s in stages or STAGES)
    if total > 420:
        problems.append(f"the stages' budgets add up to {total} s, over the 7 minutes a device call leaves for them")
    return {"card": card, "budget_total_s": total, "budgets": dict(STAGES), "cases": rows, "problems": problems}
