"""The cheap candidate pool (sampler.pool): its choice by hand, the real rollout from the chosen noises equal to a
plain rollout from them, the noise split across rollout batches, the first update's ratio, the int8 and fp8 cheap
passes, and its refusals."""

import pytest
import torch
from flowrl.samplers import RolloutPlan, StepSpec

from flowrl.candidate_pool import choose, spearman
from flowrl.engine import rollout
from flowrl.errors import ConfigError
from flowrl.low_precision import low_precision_linears, unavailable
from flowrl.trainer import Trainer

from .conftest import make_cfg

BRIGHT = "rewards=[{name: 'tests.helpers:brightness'}]"


def test_the_choice_by_hand():
    r = torch.tensor([0.1, 0.9, 0.5, 0.3, 0.7, float("nan")])
    assert choose(r, 4, "best_worst", torch.Generator()) == [0, 1, 4, 5]  # 0.9, 0.7 on top; NaN and 0.1 below
    assert choose(r, 3, "best_worst", torch.Generator()) == [1, 4, 5]  # two from the top, one from the bottom
    assert choose(r, 3, "best", torch.Generator()) == [1, 2, 4]
    picks = choose(r, 4, "random", torch.Generator().manual_seed(0))
    assert len(set(picks)) == 4 and picks == sorted(picks) and picks == choose(r, 4, "random",
                                                                                torch.Generator().manual_seed(0))
    assert spearman(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0, 30.0, 20.0])) == pytest.approx(0.5)


def test_the_real_rollout_from_the_chosen_noises_is_a_plain_rollout_from_them(tmp_path):
    cfg = make_cfg(tmp_path, "train.iterations=1", "sampler.num_steps=4", "algorithm.group_size=4",
                   "train.prompts_per_iter=2", "sampler.pool.size=8", "sampler.pool.num_steps=2",
                   "sampler.pool.select=best", BRIGHT)
    tr = Trainer(cfg)
    prompts = tr.prompts.prompts[:2]
    cond = tr.adapter.encode_prompts(prompts)
    chosen, stats = tr.pool(cond, torch.Generator().manual_seed(3), prompts, [{}, {}], [4, 4])
    assert chosen.shape == (8, *tr.latent_shape) and stats["pool/nfe"] == 2 * 8 * 2
    for g in range(2):  # "best": the chosen candidates' cheap rewards are the prompt's four highest
        top = tr.pool.cheap_rewards[g].sort(descending=True).values[:4]
        assert sorted(tr.pool.chosen_rewards[4 * g: 4 * g + 4].tolist()) == pytest.approx(sorted(top.tolist()))
    plan = tr.algorithm.plan(0)
    tree, _, _ = tr.runner(cond, plan, torch.Generator().manual_seed(9), prompts, [{}, {}], initial_noise=chosen)
    plain = rollout(tr.adapter, cond, plan, tr.sigmas, tr.latent_shape, kernel="flow_grpo", noise_level=0.7,
                    generator=torch.Generator().manual_seed(9), initial_noise=chosen, guidance_scale=1.0)
    assert torch.equal(tree.rounds[0].latents, chosen)
    assert float((tree.leaves - plain.leaves).abs().max()) == 0.0
    assert all(torch.equal(a, b) for a, b in zip(tree.log_prob, plain.log_prob))


def test_the_chosen_noises_are_split_across_rollout_batches(tmp_path):
    """Three prompts in two rollout batches: each batch starts from its own prompts' chosen noises (an ODE plan, so
    the leaves depend on the noises alone)."""
    cfg = make_cfg(tmp_path, "sampler.num_steps=3", "algorithm.group_size=2", "sampler.rollout_batches=2", BRIGHT)
    tr = Trainer(cfg)
    prompts = tr.prompts.prompts[:3]
    cond = tr.adapter.encode_prompts(prompts)
    noise = torch.randn((6, *tr.latent_shape), generator=torch.Generator().manual_seed(1))
    plan = RolloutPlan([StepSpec(sde=False)] * 3, roots_per_prompt=2)
    tree, _, timing = tr.runner(cond, plan, torch.Generator(), prompts, [{}] * 3, initial_noise=noise)
    alone = rollout(tr.adapter, cond, plan, tr.sigmas, tr.latent_shape, kernel="ode", noise_level=0.0,
                    generator=torch.Generator(), initial_noise=noise)
    assert timing["rollout_batches"] == 2
    assert float((tree.leaves - alone.leaves).abs().max()) < 1e-6


def test_a_run_with_a_pool_keeps_the_first_ratio_at_one_and_logs_the_pool(tmp_path):
    cfg = make_cfg(tmp_path, "train.iterations=1", "sampler.num_steps=3", "algorithm.group_size=3",
                   "train.prompts_per_iter=2", "sampler.pool.size=6", "sampler.pool.num_steps=2", BRIGHT)
    row = Trainer(cfg).iteration(0)
    assert row["ratio_max_abs_dev_first_update"] < 1e-6
    assert row["pool/nfe"] == 2 * 6 * 2 and 0 < row["pool/seconds_share"] < 1
    assert -1 <= row["pool/rank_correlation"] <= 1


def test_a_pool_the_plan_cannot_use_is_refused_before_the_run_folder(tmp_path):
    with pytest.raises(ConfigError, match="one shared"):
        Trainer(make_cfg(tmp_path, "algorithm.name=dance_grpo", "sampler.pool.size=8", BRIGHT))
    with pytest.raises(ConfigError, match="at least as many"):
        Trainer(make_cfg(tmp_path, "algorithm.group_size=4", "sampler.pool.size=3", BRIGHT))
    assert not any(tmp_path.iterdir())


def _weights_by_hand(w, levels, rounding):
    """Per-output-channel symmetric quantization: s = amax / levels, w ~ rounding(w / s) s."""
    s = w.abs().amax(dim=1, keepdim=True) / levels
    return rounding(w / s) * s


def _by_hand(x, w, b, precision):
    """The quantized product from its formula. int8 (PyTorch's dynamic quantization on the CPU): the activations per
    tensor, affine over [min(x, 0), max(x, 0)] in 256 levels with an integer zero point; the weights per channel in
    +-127. fp8: activation rows and weight channels each scaled to e4m3's +-448 and rounded to e4m3."""
    if precision == "int8":
        lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
        scale = (hi - lo) / 255
        zero = round(-lo / scale)
        xq = (torch.clamp(torch.round(x / scale) + zero, 0, 255) - zero) * scale
        return xq @ _weights_by_hand(w, 127.0, torch.round).t() + b
    e4m3 = lambda v: v.to(torch.float8_e4m3fn).float()  # noqa: E731
    return _weights_by_hand(x, 448.0, e4m3) @ _weights_by_hand(w, 448.0, e4m3).t() + b


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_low_precision_linears_by_hand_and_leave_the_layers_as_they_were(precision):
    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(32, 16)
    x = torch.randn(5, 32, generator=gen)
    exact = layer(x).detach()
    with low_precision_linears([torch.nn.Sequential(layer)], precision):
        cheap = layer(x.view(5, 1, 32)).view(5, 16).detach()  # leading dimensions pass through
    hand = _by_hand(x, layer.weight.detach(), layer.bias.detach(), precision)
    # int8 accumulates exactly in int32; fp8's product is returned in bf16 (8 bits of mantissa)
    assert float((cheap - hand).abs().max()) < (1e-5 if precision == "int8" else 1e-2 * float(hand.abs().max()))
    # the quantized product stays near the exact one, and far from it in the last bits (it is a different product)
    relative = float((cheap - exact).norm() / exact.norm())
    assert 1e-5 < relative < (0.02 if precision == "int8" else 0.1)
    assert "forward" not in layer.__dict__ and torch.equal(layer(x), exact)


def test_low_precision_cheap_passes_keep_the_first_ratio_and_are_refused_where_they_cannot_run(tmp_path):
    for precision in ("int8", "fp8"):
        cfg = make_cfg(tmp_path / precision, "train.iterations=1", "sampler.num_steps=3", "algorithm.group_size=3",
                       "train.prompts_per_iter=2", "sampler.pool.size=6", "sampler.pool.num_steps=2",
                       f"sampler.pool.precision={precision}", BRIGHT)
        row = Trainer(cfg).iteration(0)
        assert row["ratio_max_abs_dev_first_update"] < 1e-6 and row["pool/nfe"] == 2 * 6 * 2
    assert unavailable("int8", torch.device("cpu")) is None and unavailable("fp8", torch.device("cpu")) is None
    assert "on the CPU" in unavailable("int8", torch.device("cuda"))
