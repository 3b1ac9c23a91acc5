"""Checks that need a CUDA device (``pytest -m gpu``; `flowrl gpu-check` runs them): the rollout's hot path makes
no host synchronisation per denoising round."""

from __future__ import annotations

import warnings

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _synchronisations(fn) -> int:
    """How many synchronising CUDA operations ``fn`` performs (torch's sync debug mode, as warnings)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def test_the_rollout_synchronises_once_per_rollout_not_once_per_round(tmp_path):
    from flowrl.config import load_config
    from flowrl.engine import rollout
    from flowrl.models import load_adapter
    from flowrl.samplers.plans import RolloutPlan, StepSpec
    from flowrl.sampling import sigmas_for

    cfg = load_config(None, ["device=cuda", "log.progress=false"])
    adapter = load_adapter(cfg.model, "cuda")
    cond = adapter.encode_prompts(["a photo of a cat", "a red circle"])
    shape = adapter.latent_shape(cfg.model.resolution)

    def run(steps: int):
        plan = RolloutPlan([StepSpec(sde=True, branch=4 if i == 0 else 1, trained=True) for i in range(steps)])
        sig = sigmas_for(cfg, adapter, steps)
        return lambda: rollout(adapter, cond, plan, sig, shape, kernel="flow_grpo", noise_level=0.7,
                               generator=torch.Generator(device="cuda").manual_seed(0))

    run(4)()  # warm-up: kernels, allocator, caches
    short, long = _synchronisations(run(4)), _synchronisations(run(8))
    assert short == long, f"{short} synchronisations for 4 rounds, {long} for 8: one or more per round"
