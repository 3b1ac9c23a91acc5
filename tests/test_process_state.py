"""A trainer's setup leaves the processes of a run in step: the run seeds torch's global generator with
train.seed, so two trainers built one after the other in one process (the global generator drawn from in between)
each start as they would alone, and the memory probe's own seeding, on the main process only, is undone."""

import math

import pytest
import torch

from flowrl.config import load_config
from flowrl.randomness import keeps_generators
from flowrl.trainer import Trainer

TIMING = ("second", "time", "tflops", "mfu", "images_per_second", "peak_memory", "memory_mb")


def _trainer(out, *overrides):  # the LoRA preset: peft draws LoRA's initial weights from the global generator
    return Trainer(load_config("configs/tiny_flow_grpo.yaml", [
        f"log.output_dir={out}", "log.run_name=t", "log.progress=false", "log.sample_every=0", "log.save_every=0",
        "log.eval_every=0", "guard.enabled=false", "train.iterations=1", *overrides]))


def _differing(a: dict, b: dict) -> list[str]:
    return [k for k in a if not any(t in k for t in TIMING) and not (
        a[k] == b.get(k) or (isinstance(a[k], float) and math.isnan(a[k]) and math.isnan(b.get(k, 0.0))))]


def test_a_builder_that_seeds_itself_leaves_the_callers_generator_where_it_was():
    @keeps_generators
    def probe():
        torch.manual_seed(0)
        return torch.rand(3)

    torch.manual_seed(1234)
    before = torch.get_rng_state()
    first = probe()
    assert torch.equal(torch.get_rng_state(), before) and torch.equal(probe(), first)


@pytest.mark.heavy
def test_two_trainers_one_after_the_other_start_as_each_alone(tmp_path):
    torch.manual_seed(7)
    first = _trainer(tmp_path / "a").iteration(0)
    torch.rand(12345)  # whatever the caller does with the global generator in between
    second = _trainer(tmp_path / "b").iteration(0)
    assert first["reward_mean/total"] == second["reward_mean/total"]
    assert not _differing(first, second), _differing(first, second)
