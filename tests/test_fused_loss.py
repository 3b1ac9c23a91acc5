"""train.fused_loss: the per-edge log-prob, ratio, clip and KL as one torch.compile'd function equal the eager path,
in value and in gradient (CPU inductor), and the trainer's fused path equals its eager path."""

import pytest
import torch

from flowrl import losses
from flowrl.samplers.kernels import step as kernel_step


def _eager_reference(x, v, s, s_next, prev, old, adv, v_ref, clip):
    """The trainer's eager chain: kernel log-prob, then the PPO clip, then the KL (transition std)."""
    out = kernel_step("flow_grpo", x, v, s, s_next, noise_level=0.7, sigma_at_one=0.95, prev_sample=prev)
    loss, ratio = losses.ppo_clip_loss(out.log_prob - old, torch.zeros_like(old), adv, clip)
    ref = kernel_step("flow_grpo", x, v_ref, s, s_next, noise_level=0.7, sigma_at_one=0.95, prev_sample=prev)
    kl = losses.gaussian_kl_same_std(out.mean, ref.mean, out.std)
    return loss, ratio, out.log_prob, kl


def test_compiled_edge_objective_equals_eager_values_and_gradients():
    g = torch.Generator().manual_seed(0)
    e = 6
    x = torch.randn(e, 4, 8, 8, generator=g)
    v0 = torch.randn(e, 4, 8, 8, generator=g)
    s = torch.tensor([0.9, 0.9, 0.7, 0.7, 0.5, 0.3])
    s_next = s - 0.1
    v_ref = v0 + 0.05 * torch.randn(e, 4, 8, 8, generator=g)
    prev = kernel_step("flow_grpo", x, v0, s, s_next, noise_level=0.7, sigma_at_one=0.95,
                       noise=torch.randn(e, 4, 8, 8, generator=g)).sample
    old = kernel_step("flow_grpo", x, v0, s, s_next, noise_level=0.7, sigma_at_one=0.95, prev_sample=prev).log_prob
    adv = torch.tensor([1.5, -0.5, 2.0, -2.0, 0.3, -1.0])
    clip = 1e-2
    # a moved policy, so that some ratios leave the clip range and the max picks both branches
    v_pol = v0 + 0.3 * torch.randn(e, 4, 8, 8, generator=g)

    results = {}
    for name, fn in (("eager", losses.edge_objective), ("compiled", losses.compiled_edge_objective())):
        v = v_pol.clone().requires_grad_(True)
        loss, ratio, logp, kl = fn(x, v, s, s_next, prev, old, adv, v_ref, kernel="flow_grpo", noise_level=0.7,
                                   sigma_at_one=0.95, clip_range=clip)
        (loss.sum() + 0.1 * kl.sum()).backward()
        results[name] = (loss.detach(), ratio.detach(), logp.detach(), kl.detach(), v.grad)
    reference = _eager_reference(x, v_pol, s, s_next, prev, old, adv, v_ref, clip)
    for a, b in zip(results["eager"][:4], reference):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-8)
    clipped = ((results["eager"][1] - 1).abs() > clip)
    assert 0 < int(clipped.sum()) < e  # both branches of the clip are exercised
    for a, b in zip(results["eager"], results["compiled"]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), (a - b).abs().max()
    assert results["compiled"][4].abs().sum() > 0


def test_trainer_fused_path_equals_eager_path(tmp_path, monkeypatch):
    """The trainer's wiring of the fused objective (the compiled function swapped for its eager twin, which the
    test above holds equal): one iteration with KL gives the same ratios, losses, gradient norm and weights."""
    from tests.conftest import make_cfg
    from flowrl.trainer import Trainer

    monkeypatch.setattr(losses, "compiled_edge_objective", lambda: losses.edge_objective)
    rows, weights = {}, {}
    for fused in (False, True):
        cfg = make_cfg(tmp_path / str(fused), "train.iterations=1", "train.prompts_per_iter=2", "algorithm.group_size=3",
                       "sampler.num_steps=4", "train.kl_beta=0.05", "train.lr=1e-2", "train.num_minibatches=2", f"train.fused_loss={fused}")
        trainer = Trainer(cfg)
        rows[fused] = trainer.iteration(0)
        weights[fused] = torch.cat([p.detach().flatten() for p in trainer.policy.params])
    for k in ("ratio_mean", "ratio_std", "clipfrac", "policy_loss", "kl_loss", "grad_norm", "approx_kl"):
        assert rows[True][k] == pytest.approx(rows[False][k], rel=1e-5, abs=1e-12), k
    assert rows[False]["kl_loss"] > 0
    assert torch.allclose(weights[True], weights[False], atol=1e-7)


def _one_iteration(tmp_path, *extra):
    from tests.conftest import make_cfg
    from flowrl.trainer import Trainer

    cfg = make_cfg(tmp_path, "train.iterations=1", "train.prompts_per_iter=2", "algorithm.group_size=3",
                   "sampler.num_steps=4", *extra)
    return Trainer(cfg).iteration(0)


def test_gradient_checkpointing_gives_the_same_update(tmp_path):
    plain = _one_iteration(tmp_path / "a")
    ckpt = _one_iteration(tmp_path / "b", "train.gradient_checkpointing=true")
    assert ckpt["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-6) and plain["grad_norm"] > 0
    assert ckpt["reward_mean/total"] == plain["reward_mean/total"]


@pytest.mark.slow
def test_compiled_blocks_give_the_same_update(tmp_path):
    """train.compile_transformer (inductor on the CPU; about 1.5 minutes of compilation)."""
    plain = _one_iteration(tmp_path / "a")
    compiled = _one_iteration(tmp_path / "b", "train.compile_transformer=true")
    assert compiled["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)
    assert compiled["reward_mean/total"] == pytest.approx(plain["reward_mean/total"], abs=1e-6)
