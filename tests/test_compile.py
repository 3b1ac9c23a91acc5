"""train.compile_transformer: the repeated blocks compiled once (regional torch.compile, dynamic shapes) give the
eager transformer's loss and LoRA gradients, and a second micro-batch size reuses the compiled code."""

from __future__ import annotations

import copy

import pytest
import torch

from flowrl.config import load_config


@pytest.mark.heavy
def test_compiled_blocks_equal_eager_and_compile_once_for_two_batch_sizes():
    from torch._dynamo.utils import counters

    from flowrl.models import load_adapter
    from flowrl.policy import add_lora, configure_update_path

    torch._dynamo.reset()
    cfg = load_config("configs/tiny_flow_grpo.yaml", ["train.compile_transformer=true"])
    adapter = load_adapter(cfg.model, "cpu")
    tr = adapter.transformer.requires_grad_(False)
    add_lora(tr, cfg.train.lora, adapter.lora_targets)
    for p in tr.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    eager = copy.deepcopy(tr)
    configure_update_path(tr, cfg.train)
    shape = adapter.latent_shape(cfg.model.resolution)

    def loss_and_grads(model, n: int):
        adapter.transformer = model
        x = torch.randn(n, *shape, generator=torch.Generator().manual_seed(n))
        v = adapter.velocity(x, torch.linspace(0.3, 0.9, n), adapter.encode_prompts(["a red circle on a blue background"] * n))
        loss = (v.square() * torch.arange(1, n + 1).view(-1, 1, 1, 1)).mean()
        return loss.detach(), torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])

    graphs = []
    for n in (2, 3):
        loss_c, grads_c = loss_and_grads(tr, n)
        graphs.append(counters["stats"]["unique_graphs"])
        loss_e, grads_e = loss_and_grads(eager, n)
        assert torch.allclose(loss_c, loss_e, rtol=1e-6, atol=0), (float(loss_c), float(loss_e))
        for gc, ge in zip(grads_c, grads_e, strict=True):
            assert torch.allclose(gc, ge, rtol=1e-4, atol=1e-7)
    assert graphs[0] > 0 and graphs[1] == graphs[0]  # batch 3 ran the code compiled for batch 2
