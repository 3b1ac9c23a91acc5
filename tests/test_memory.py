"""``flowrl memory``: the state bytes it predicts are what a run holds, its activation scaling reproduces the bytes
the whole model saves, and the published architectures give their known sizes without a download."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flowrl.config import load_config
from flowrl.memory import _saved_bytes, activation_bytes, architecture, estimate

ROOT = Path(__file__).resolve().parent.parent


def test_predicted_state_bytes_equal_what_a_run_holds(tmp_path):
    from flowrl.trainer import Trainer

    cfg = load_config("configs/tiny_flow_grpo.yaml", ["train.iterations=1", f"log.output_dir={tmp_path}", "log.run_name=m",
                                                      "log.sample_every=0", "log.save_every=0", "log.progress=false",
                                                      "train.prompts_per_iter=2"])
    trainer = Trainer(cfg)
    row = trainer.iteration(0)
    row_full = {**row}
    predicted = estimate(cfg, [1])["per_process_gib"][0]
    for part in ("weights", "gradients", "optimizer"):
        assert predicted[part] * 1024 == pytest.approx(row_full[f"memory/{part}_mb"], rel=1e-6), part


@pytest.mark.parametrize("overrides", [[], ["train.micro_batch=3", "model.tiny.num_layers=3"]])
def test_activation_scaling_reproduces_the_whole_models_saved_bytes(overrides):
    """The tiny model is narrow enough to be its own replica (width x1), so the per-block scaling from one- and
    two-block copies must give what the whole model saves in one forward, times the micro-batch."""
    from flowrl.models import load_adapter
    from flowrl.models.common import PromptEmbeds

    cfg = load_config("configs/tiny_flow_grpo.yaml", overrides)
    adapter = load_adapter(cfg.model)
    cond = adapter.encode_prompts(["a red circle"])
    shape = adapter.latent_shape(cfg.model.resolution)
    model = adapter.transformer.train()

    def velocity(m):
        adapter._forward(torch.randn(1, *shape), torch.full((1,), 0.5),
                         PromptEmbeds(torch.randn_like(cond.embeds), torch.randn_like(cond.pooled)))

    whole = _saved_bytes(model, velocity)
    predicted, notes = activation_bytes(cfg, architecture(cfg.model))
    assert predicted == pytest.approx(whole * cfg.train.micro_batch, rel=0.02)
    assert "scaled x1 by width" in notes[0]


def test_memory_of_the_published_architectures_without_weights():
    done = subprocess.run([sys.executable, "-m", "flowrl", "memory", "configs/flux1_dev_flow_grpo.yaml", "--world-size",
                           "1,8", "--fsdp", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert out["model"] == "FluxTransformer2DModel"
    assert out["parameters"] == pytest.approx(11.90e9, rel=1e-3)  # FLUX.1-dev's 12B transformer
    one, eight = out["per_process_gib"]
    for part in ("weights", "gradients", "optimizer"):
        assert eight[part] == pytest.approx(one[part] / 8, rel=1e-9)
    assert eight["activations"] == one["activations"] > 0  # activations are not sharded
    # bf16 frozen weights (2 bytes each) plus the fp32 LoRA: FLUX.1-dev's 23.8 GB checkpoint
    assert one["weights"] * 2 ** 30 == pytest.approx(out["parameters"] * 2 + out["trained"] * 4, rel=1e-9)
