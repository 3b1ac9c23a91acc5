"""``flowrl gpu-check --plan``: what a CPU cannot execute of the GPU check, planned against a named card.

It reads the check's stages (``gpu_check.BENCH``, ``STAGES``) and the bench's own batch selection and FLOP-counting
rule (``gpu_bench.auto_batch``, ``flop_count_edges``), so the same file planned against an older check names that
check's failing case."""

from __future__ import annotations

import json

H100_PEAK_TFLOPS = 989.0
STARTUP_S = 15.0  # a stage's process start-up and imports, measured on the earlier H100 run
UPDATE_OVER_FORWARD = 2.0  # a LoRA update step's FLOPs per edge over one forward (1.9-2.1 measured)
CARDS = {"H100 80GB": 79 * 2 ** 30, "H200": 139 * 2 ** 30, "A100 80GB": 79 * 2 ** 30, "A100 40GB": 39 * 2 ** 30}
PLAN_MARGIN = 0.9  # a case fits when its predicted peak is at most this share of the card


def plan_check(card: str = "H100 80GB", tiny: bool = False, stages: list[str] | None = None, emit=print) -> dict:
    """What a CPU cannot execute, planned: for every benchmark stage's family, resolution and update case, the
    micro-batch the real run picks (the same batch-selection code), the predicted peak of the timed step and of
    the FLOP-counting step beside the card; every stage's rollout plans built; each benchmark stage's seconds
    predicted from the measured H100 rates (:func:`predicted_stage_seconds`) against its budget; the budgets
    summed. Returns the plan with ``problems`` (empty when everything fits)."""
    import torch

    from . import gpu_bench, gpu_check
    from .errors import ConfigError
    from .gpu_bench import UPDATE_CASES, auto_batch, rollout_plan
    from .gpu_check import BENCH, STAGES

    most_batch = getattr(gpu_check, "MOST_BATCH", 16)  # the largest micro-batch a stage times (per case)

    def most(case: str) -> int:
        return most_batch[case] if isinstance(most_batch, dict) else most_batch

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
            # the FLOPs are counted without checkpointing, on as many edges as the bench's rule says (one probe of
            # the plain step's memory serves both cases)
            try:
                plain = auto_batch(family, px, cpu, False, most("update"), capacity)[1]
            except ConfigError as exc:  # not even one edge fits the card
                problems.append(f"{name}: update at {px} px: {exc}")
                continue
            for case in ("update", "update checkpointing"):
                ckpt = UPDATE_CASES[case][1]
                try:
                    batch, why = auto_batch(family, px, cpu, ckpt, most(case), capacity)
                except ConfigError as exc:  # not even one edge fits the card
                    problems.append(f"{name}: {case} at {px} px: {exc}")
                    continue
                timed = why["state_gib"] + batch * why["activations_per_input_gib"]
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
    predicted = {}
    if not tiny:  # each benchmark stage's seconds, predicted from the measured rates, against its budget
        for name in stages or list(STAGES):
            if name in BENCH:
                seconds = predicted[name] = round(predicted_stage_seconds(
                    name, [r for r in rows if r["stage"] == name]), 1)
                emit(json.dumps({"stage": name, "predicted_s": seconds, "budget_s": STAGES[name]}))
                if seconds > STAGES[name]:
                    problems.append(f"{name}: predicted {seconds:.0f} s from the measured H100 rates, over its "
                                    f"budget of {STAGES[name]} s")
    total = sum(STAGES[s] for s in stages or STAGES)
    if total > 420:
        problems.append(f"the stages' budgets add up to {total} s, over the 7 minutes a device call leaves for them")
    return {"card": card, "budget_total_s": total, "budgets": dict(STAGES), "predicted_s": predicted, "cases": rows,
            "problems": problems}


def forward_tflop_per_row(family: str, px: int) -> float:
    """One forward's FLOPs per row (TFLOP) of the family's published transformer at ``px``, counted by
    FlopCounterMode on the meta device (no weights, no compute; seconds on a CPU)."""
    import diffusers
    import torch

    from . import gpu_bench

    cls = getattr(diffusers, gpu_bench.CLASSES[family])
    real_autocast = torch.autocast

    class MetaAutocast(real_autocast):  # autocast has no meta device: the meta forward runs as on a CPU
        def __init__(self, device_type, *args, **kwargs):
            super().__init__("cpu" if device_type == "meta" else device_type, *args, **kwargs)

    torch.autocast = torch.amp.autocast = MetaAutocast
    try:
        with torch.device("meta"):
            transformer = cls(**gpu_bench.REAL[family])
        model = gpu_bench.BenchModel(family, transformer, torch.device("meta"), torch.float32)
        return gpu_bench.forward_flops_per_row(model, px, False) / 1e12
    finally:
        torch.autocast = torch.amp.autocast = real_autocast


def predicted_stage_seconds(name: str, cases: list[dict]) -> float:
    """A benchmark stage's wall time on one H100 from the measured rates: start-up, then per resolution the two
    update cases at their planned batches (the one-edge FLOP count, a warm-up and three timed steps) and the flat
    and tree rollouts (a two-step warm-up and the timed rollout, each at its plan's evaluations)."""
    import statistics

    from . import gpu_bench
    from .gpu_bench import rollout_plan
    from .gpu_check import BENCH

    family, sizes = BENCH[name]
    measured = list(gpu_bench.MEASURED_H100_MFU.values())
    median = tuple(statistics.median(m[i] for m in measured) for i in range(3))
    peak = H100_PEAK_TFLOPS
    seconds = STARTUP_S
    for px, (steps, chains) in sizes.items():
        try:
            forward = forward_tflop_per_row(family, px)
        except RuntimeError:  # a forward the meta device cannot run (a .item() inside): the largest image
            forward = forward_tflop_per_row(*gpu_bench.LARGEST_FORWARD)  # family's, so the prediction errs long
        update_mfu, checkpointed_mfu, rollout_mfu = gpu_bench.MEASURED_H100_MFU.get((family, px), median)
        for case in cases:
            if case["px"] != px:
                continue
            mfu = checkpointed_mfu if case["case"] == "update checkpointing" else update_mfu
            per_edge = UPDATE_OVER_FORWARD * forward / (mfu * peak)
            # the one-edge FLOP count, the warm-up and the timed steps
            seconds += per_edge * (1 + (1 + getattr(gpu_bench, "UPDATE_REPEATS", 3)) * case["batch"])
        for tree in (False, True):
            nfe = rollout_plan(tree, steps, chains).counts()["nfe"]
            seconds += (nfe + 2 * chains) * forward / (rollout_mfu * peak)  # the timed rollout and its warm-up
    return seconds
