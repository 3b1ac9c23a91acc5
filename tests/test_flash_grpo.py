"""Flash-GRPO: its kernel, the velocity-gradient scale lambda written out from the published formula, the weights
1 / lambda over their batch mean, and the engine's per-prompt steps (each prompt's rollout equals its own plan's)."""

import math
import random

import pytest
import torch
from flowrl.samplers import RolloutPlan, StepSpec, make_sigmas
from flowrl.samplers.kernels import step as kernel_step

from flowrl.algorithms.flash_grpo import FlashGRPO, gradient_scale
from flowrl.config import load_config
from flowrl.engine import rollout

PROMPTS = ["a red circle on a blue background", "a green square on a white background"]


def test_the_flash_kernel_by_hand():
    """g = a sigma_1 sigma; mean = x (1 + g^2 dt / (2 s)) + v (1 + g^2 (1 - s) / (2 s)) dt; std = g sqrt(-dt)."""
    x, v = torch.tensor([[0.3, -1.2]]), torch.tensor([[0.5, 0.25]])
    s, s_next, sigma_1, a = 0.8, 0.6, 0.95, 0.9
    out = kernel_step("flash", x, v, s, s_next, noise_level=a, sigma_at_one=sigma_1, noise=torch.zeros(1, 2))
    g, dt = a * sigma_1 * s, s_next - s
    mean = [xi * (1 + g * g * dt / (2 * s)) + vi * (1 + g * g * (1 - s) / (2 * s)) * dt for xi, vi in ((0.3, 0.5),
                                                                                                       (-1.2, 0.25))]
    assert out.mean[0].tolist() == pytest.approx(mean, abs=1e-6)
    assert float(out.std.flatten()[0]) == pytest.approx(g * math.sqrt(-dt), abs=1e-7)


@pytest.mark.parametrize("kernel", ["flash", "flow_grpo", "dance"])
def test_the_log_probs_velocity_gradient_is_minus_xi_lambda(kernel):
    """d log pi / d v = -xi * lambda(s) elementwise, lambda = sqrt|dt| / g + g sqrt|dt| (1 - s) / (2 s) (the paper's
    eq.), for every kernel with the Flow-SDE drift: the weight the method divides by is the true gradient scale."""
    gen = torch.Generator().manual_seed(0)
    x, xi = torch.randn(3, 4, generator=gen), torch.randn(3, 4, generator=gen)
    v = torch.randn(3, 4, generator=gen, requires_grad=True)
    s, s_next = 0.7, 0.55
    sample = kernel_step(kernel, x, v.detach(), s, s_next, noise_level=0.8, sigma_at_one=0.97, noise=xi).sample
    out = kernel_step(kernel, x, v, s, s_next, noise_level=0.8, sigma_at_one=0.97, prev_sample=sample, reduce="sum")
    (grad,) = torch.autograd.grad(out.log_prob.sum(), v)
    lam = gradient_scale(s, s_next, float(out.std.flatten()[0]))
    assert torch.allclose(grad, -xi * lam, atol=1e-4), (grad + xi * lam).abs().max()


def test_each_prompt_draws_one_step_its_group_shares():
    cfg = load_config("configs/tiny_shapes_flash_grpo.yaml", ["train.prompts_per_iter=6"])
    algo = FlashGRPO(cfg)
    seen = set()
    for it in range(20):
        plan = algo.plan(it, random.Random(it))
        assert plan.roots_per_prompt == 8 and len(plan.prompt_steps) == 6
        for variant in plan.prompt_steps:
            j = [i for i, s in enumerate(variant) if s.sde]
            assert len(j) == 1 and j[0] < 5 and variant[j[0]].trained and sum(s.trained for s in variant) == 1
            seen.add(j[0])
    assert seen == set(range(5))  # every candidate in the first half of the 10 steps is drawn


@pytest.fixture(scope="module")
def per_prompt(tiny_adapter):
    """A rollout where prompt 0 is stochastic at step 0 and prompt 1 at step 2 (two roots each, four steps)."""
    steps = {j: [StepSpec(sde=i == j, trained=i == j) for i in range(4)] for j in (0, 2)}
    plan = RolloutPlan(steps[0], roots_per_prompt=2, prompt_steps=[steps[0], steps[2]])
    sigmas = make_sigmas("static_shift", 4, 3.0)
    shape = tiny_adapter.latent_shape(16)
    noise = torch.randn((4, *shape), generator=torch.Generator().manual_seed(1))
    kw = dict(kernel="flash", noise_level=1.0)
    tree = rollout(tiny_adapter, tiny_adapter.encode_prompts(PROMPTS), plan, sigmas, shape, initial_noise=noise,
                   generator=torch.Generator().manual_seed(5), **kw)
    return tree, steps, sigmas, shape, noise, kw


def test_a_per_prompt_rollout_equals_each_prompts_own_plan(tiny_adapter, per_prompt):
    tree, steps, sigmas, shape, noise, kw = per_prompt
    # prompt 0 alone: its SDE step draws the generator's first noise; prompt 1's draws the second
    gen = torch.Generator().manual_seed(5)
    alone0 = rollout(tiny_adapter, tiny_adapter.encode_prompts(PROMPTS[:1]), RolloutPlan(steps[0], roots_per_prompt=2),
                     sigmas, shape, initial_noise=noise[:2], generator=gen, **kw)
    gen = torch.Generator().manual_seed(5)
    torch.randn((2, *shape), generator=gen)
    alone1 = rollout(tiny_adapter, tiny_adapter.encode_prompts(PROMPTS[1:]), RolloutPlan(steps[2], roots_per_prompt=2),
                     sigmas, shape, initial_noise=noise[2:], generator=gen, **kw)
    assert torch.allclose(tree.leaves[:2], alone0.leaves, atol=1e-5), (tree.leaves[:2] - alone0.leaves).abs().max()
    assert torch.allclose(tree.leaves[2:], alone1.leaves, atol=1e-5), (tree.leaves[2:] - alone1.leaves).abs().max()
    for r in range(1, 5):  # the trained edge of each trajectory is its prompt's step, and only it has a log-prob
        on = (tree.group[r] == 0) if r == 1 else (tree.group[r] == 1) if r == 3 else torch.zeros(4, dtype=torch.bool)
        assert tree.trained[r].tolist() == on.tolist() and tree.sde[r].tolist() == on.tolist()
        assert bool((tree.log_prob[r][~on] == 0).all()) and bool((tree.log_prob[r][on] != 0).all())
    assert tree.log_prob[1][:2].tolist() == pytest.approx(alone0.log_prob[1].tolist(), abs=1e-5)
    assert tree.log_prob[3][2:].tolist() == pytest.approx(alone1.log_prob[3].tolist(), abs=1e-5)


def test_the_step_weights_are_one_over_lambda_over_their_batch_mean(per_prompt):
    """By hand: g = sigma_1 s_j, std = g sqrt|dt|, c_j = 1 / lambda(s_j); two edges at step 0 and two at step 2, so
    the mean is (c_0 + c_2) / 2."""
    tree, *_ = per_prompt
    grid = tree.sigmas.tolist()
    c = {}
    for j in (0, 2):
        g = grid[1] * grid[j]
        dt = grid[j] - grid[j + 1]
        c[j] = 1 / (math.sqrt(dt) / g + g * math.sqrt(dt) * (1 - grid[j]) / (2 * grid[j]))
    algo = FlashGRPO(load_config("configs/tiny_shapes_flash_grpo.yaml"))
    weights = algo.loss_weights(tree, tree.trained)
    mean = (c[0] + c[2]) / 2
    assert weights == pytest.approx({0: c[0] / mean, 2: c[2] / mean}, rel=1e-5)
    assert weights[2] < 1 < weights[0]  # lambda grows as sigma -> 0: the later step's gradient is damped
    off = FlashGRPO(load_config("configs/tiny_shapes_flash_grpo.yaml", ["algorithm.step_weight=none"]))
    assert off.loss_weights(tree, tree.trained) is None


def test_bad_settings_are_refused_in_one_line():
    from flowrl.errors import ConfigError

    with pytest.raises(ConfigError, match="sampler.kernel"):
        load_config("configs/tiny_shapes_flash_grpo.yaml", ["sampler.kernel=cps"])
    with pytest.raises(ConfigError, match="candidate_fraction"):
        load_config("configs/tiny_shapes_flash_grpo.yaml", ["algorithm.candidate_fraction=0.05"])
    with pytest.raises(ValueError, match="only in sde and trained"):
        RolloutPlan([StepSpec()] * 2, prompt_steps=[[StepSpec(branch=2), StepSpec()]])
