"""Checks that need a CUDA device (``pytest -m gpu``; `flowrl gpu-check` runs them): the rollout's hot path makes
no host synchronisation per denoising round; the candidate pool's fp8 linear layers compute their formula on the
GPU's FP8 tensor cores."""

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


def test_an_optimisation_step_synchronises_as_often_for_8_steps_as_for_4(tmp_path):
    """One update of Flow-GRPO on every step, all its trained edges in one micro-batch: the update's host
    synchronisations (index copies, per-round gathers) do not grow with the number of denoising steps."""
    from flowrl import trainer as trainer_module
    from flowrl.config import load_config
    from flowrl.trainer import Trainer

    counts = {}
    optimise = trainer_module.optimise
    for steps in (4, 8):
        cfg = load_config("configs/tiny_flow_grpo.yaml", [
            "device=cuda", "log.progress=false", "log.sample_every=0", "log.eval=none", f"sampler.num_steps={steps}",
            "train.prompts_per_iter=2", "train.micro_batch=4096", "train.num_minibatches=1", "train.inner_epochs=1",
            "algorithm.timestep_fraction=1.0", f"log.output_dir={tmp_path}", f"log.run_name=s{steps}"])
        trainer = Trainer(cfg)
        trainer.iteration(0)  # warm-up: kernels, allocator, caches

        def counted(*args, _steps=steps, **kwargs):
            result = []
            counts[_steps] = _synchronisations(lambda: result.append(optimise(*args, **kwargs)))
            return result[0]

        trainer_module.optimise = counted
        try:
            trainer.iteration(1)
        finally:
            trainer_module.optimise = optimise
    assert counts[4] == counts[8], f"{counts[4]} synchronisations for 4 steps, {counts[8]} for 8"


def test_fp8_linear_layers_compute_their_formula_on_the_gpu():
    """On a GPU with FP8 tensor cores: an fp8 layer equals its formula (e4m3 rows and channels, bf16 output)."""
    from flowrl.low_precision import low_precision_linears, unavailable

    device = torch.device("cuda")
    why = unavailable("fp8", device)
    if why:
        pytest.skip(why)
    gen = torch.Generator(device="cuda").manual_seed(0)
    layer = torch.nn.Linear(64, 32, device=device)
    x = torch.randn(8, 64, device=device, generator=gen)
    e4m3 = lambda v: v.to(torch.float8_e4m3fn).float()  # noqa: E731

    def by_hand(v, levels=448.0):
        s = v.abs().amax(dim=1, keepdim=True) / levels
        return e4m3(v / s) * s

    hand = by_hand(x) @ by_hand(layer.weight.detach()).t() + layer.bias.detach()
    with torch.no_grad(), low_precision_linears([layer], "fp8"):
        cheap = layer(x)
    assert float((cheap - hand).abs().max()) < 1e-2 * float(hand.abs().max())
