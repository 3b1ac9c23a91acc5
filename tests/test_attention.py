"""train.attention_backend: the SDPA kernels allowed inside every transformer call of the rollout and of the update
(its backward's recomputation under gradient checkpointing included), never cuDNN's by default."""

from __future__ import annotations

import pytest
import torch

from flowrl.attention import attention_kernels
from flowrl.config import load_config
from flowrl.errors import ConfigError


def sdpa_kernels_in_force() -> dict[str, bool]:
    """Which SDPA kernels PyTorch may use now (what :func:`attention_kernels` sets)."""
    import torch

    b = torch.backends.cuda
    return {"flash": b.flash_sdp_enabled(), "efficient": b.mem_efficient_sdp_enabled(), "math": b.math_sdp_enabled(),
            "cudnn": b.cudnn_sdp_enabled()}


SAFE = {"flash": True, "efficient": True, "math": True, "cudnn": False}


def _calls_by_phase(tmp_path, backend: str):
    from flowrl.trainer import Trainer

    cfg = load_config("configs/tiny_flow_grpo.yaml", [
        "train.iterations=1", "train.prompts_per_iter=2", f"log.output_dir={tmp_path}", f"log.run_name={backend}",
        "log.sample_every=0", "log.save_every=0", "log.progress=false", "log.eval=none",
        "train.gradient_checkpointing=true", f"train.attention_backend={backend}"])
    trainer = Trainer(cfg)
    seen = []  # (where, phase, kernels in force, PyTorch's priority order)

    def record(where):
        def hook(module, args, kwargs):
            backward = torch._C._current_graph_task_id() != -1  # inside autograd's backward: a recomputation
            seen.append((where + (" recomputed" if backward else ""), trainer.meter.current, sdpa_kernels_in_force(),
                         torch._C._get_sdp_priority_order()[:3]))
        return hook

    module = trainer.policy.module
    module.register_forward_pre_hook(record("transformer"), with_kwargs=True)
    module.transformer_blocks[0].register_forward_pre_hook(record("block"), with_kwargs=True)
    trainer.train()
    return seen


def test_the_default_keeps_cudnn_attention_out_of_the_rollout_the_update_and_its_recomputation(tmp_path):
    before = sdpa_kernels_in_force()
    seen = _calls_by_phase(tmp_path, "native")
    phases = {(where, phase) for where, phase, _, _ in seen}
    assert {("transformer", "rollout"), ("transformer", "update"), ("block recomputed", "update")} <= phases
    for where, phase, kernels, order in seen:
        assert kernels == SAFE, (where, phase, kernels)
        assert order == [1, 2, 0], (where, phase, order)  # flash, then memory-efficient, then math
    assert sdpa_kernels_in_force() == before  # PyTorch's own setting is back after training


def test_native_cudnn_gives_pytorch_its_own_choice(tmp_path):
    seen = _calls_by_phase(tmp_path, "native_cudnn")
    assert seen and all(kernels["cudnn"] and kernels["flash"] for _, _, kernels, _ in seen)


def test_attention_kernels_nest_and_restore():
    before = sdpa_kernels_in_force()
    with attention_kernels("native"):
        assert sdpa_kernels_in_force() == SAFE
        with attention_kernels("native_cudnn"):  # asks for nothing: the outer choice stays
            assert sdpa_kernels_in_force() == SAFE
    assert sdpa_kernels_in_force() == before


def test_an_unknown_attention_backend_is_one_line_listing_the_choices():
    with pytest.raises(ConfigError) as err:
        load_config("configs/tiny_flow_grpo.yaml", ["train.attention_backend=cudnn"])
    assert "native_cudnn" in str(err.value) and "\n" not in str(err.value)
