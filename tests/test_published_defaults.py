"""Defaults that follow the methods' published code, each computed here by hand from the published rule on small
inputs and compared with ours."""

from __future__ import annotations

import pytest
import torch


def _cfg_gradients(adapter, unconditional_grad: bool | None):
    """Gradients of sum(w * v) over the transformer's trained weights, with v the CFG velocity at g = 4.5: ours
    (``unconditional_grad`` given) or, for None, the published rule written out (two forwards, the negative half
    detached)."""
    g = 4.5
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, *adapter.latent_shape(16), generator=gen)
    sigma = torch.tensor([0.9, 0.6, 0.3])
    cond = adapter.encode_prompts(["a red circle", "a blue square", "two green triangles"])
    negative = adapter.encode_prompts([""])
    weight = torch.randn(x.shape, generator=gen)
    params = [p for p in adapter.transformer.parameters() if p.is_floating_point()]
    for p in params:
        p.requires_grad_(True)
        p.grad = None
    if unconditional_grad is None:  # Flow-GRPO's compute_log_prob: noise_pred_uncond.detach()
        neg = type(cond)(negative.embeds.expand(3, -1, -1), negative.pooled.expand(3, -1), None)
        v_neg = adapter._forward(x, sigma, neg).detach()
        v_pos = adapter._forward(x, sigma, cond)
        v = v_neg + g * (v_pos - v_neg)
    else:
        v = adapter.velocity(x, sigma, cond, g, negative, unconditional_grad=unconditional_grad)
    (weight * v).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in params])
    for p in params:
        p.grad = None
        p.requires_grad_(False)
    return v.detach(), grads


def test_cfg_s_unconditional_half_carries_no_gradient_by_default(tiny_adapter, tiny_cfg):
    """The update's CFG velocity: the same values either way; by default (train.cfg_unconditional_grad=false) the
    gradient is the published one (the negative half detached), and with the option on it is the old one, which
    differs (cosine well below 1)."""
    assert tiny_cfg.train.cfg_unconditional_grad is False
    v_pub, g_pub = _cfg_gradients(tiny_adapter, None)
    v_ours, g_ours = _cfg_gradients(tiny_adapter, False)
    v_all, g_all = _cfg_gradients(tiny_adapter, True)
    assert torch.allclose(v_ours, v_pub, atol=1e-5) and torch.allclose(v_all, v_pub, atol=1e-5)
    assert torch.allclose(g_ours, g_pub, rtol=1e-4, atol=1e-7)
    cosine = torch.nn.functional.cosine_similarity(g_all, g_pub, dim=0).item()
    assert cosine < 0.99 and g_all.norm() > 0


def test_the_update_passes_the_option_only_under_cfg(tmp_path):
    """velocities() asks for the constant unconditional half only where CFG applies, so an adapter whose velocity
    has the old signature still trains without CFG."""
    from types import SimpleNamespace

    from flowrl.objectives import velocities

    seen = []

    class OldSignature:
        def velocity(self, x, sigma, cond, guidance_scale=1.0, negative=None):
            seen.append(guidance_scale)
            return x * 2

    class Accelerator:
        def autocast(self):
            return torch.autocast("cpu", enabled=False)

    cfg = SimpleNamespace(sampler=SimpleNamespace(guidance_scale=4.5), train=SimpleNamespace(
        cfg=False, cfg_unconditional_grad=False))
    parts = SimpleNamespace(cfg=cfg, policy=SimpleNamespace(accelerator=Accelerator()), adapter=OldSignature(),
                            negative=None)
    v, v_ref = velocities(parts, torch.ones(2, 3), torch.tensor([0.5, 0.5]), None, with_reference=False)
    assert seen == [1.0] and v_ref is None and torch.equal(v, torch.full((2, 3), 2.0))
    with pytest.raises(TypeError, match="unconditional_grad"):
        cfg.train.cfg = True
        parts.negative = object()
        velocities(parts, torch.ones(2, 3), torch.tensor([0.5, 0.5]), None, with_reference=False)
