"""Each step kernel against its published formula, evaluated by hand with plain floats."""

import math

import pytest
import torch
from flowrl.samplers import (
    cps_step,
    dance_sde_step,
    flow_grpo_sde_step,
    gaussian_log_prob,
    ode_step,
    static_shift_sigmas,
)

X, V, EPS = 0.3, -1.2, 0.5  # one latent element
S, S_NEXT = 0.6, 0.45


def t(v):
    return torch.tensor([[v]], dtype=torch.float32)  # (B=1, 1)


def logn(x, m, s):
    return -((x - m) ** 2) / (2 * s * s) - math.log(s) - 0.5 * math.log(2 * math.pi)


def test_ode_step_is_euler():
    out = ode_step(t(X), t(V), S, S_NEXT)
    assert out.sample.item() == pytest.approx(X + (S_NEXT - S) * V)  # 0.3 + (-0.15)(-1.2) = 0.48
    assert out.sample.item() == pytest.approx(0.48)
    assert out.log_prob.item() == 0.0


def test_flow_grpo_sde_matches_paper_formula():
    a = 0.7
    dt = S_NEXT - S
    std_dev = a * math.sqrt(S / (1 - S))
    mean = X * (1 + std_dev**2 / (2 * S) * dt) + V * (1 + std_dev**2 * (1 - S) / (2 * S)) * dt
    std = std_dev * math.sqrt(-dt)
    out = flow_grpo_sde_step(t(X), t(V), S, S_NEXT, noise_level=a, noise=t(EPS))
    assert out.mean.item() == pytest.approx(mean, rel=1e-6)
    assert out.std.item() == pytest.approx(std, rel=1e-6)
    assert out.sample.item() == pytest.approx(mean + std * EPS, rel=1e-6)
    assert out.log_prob.item() == pytest.approx(logn(mean + std * EPS, mean, std), rel=1e-5)
    # golden numbers, worked by hand: std_dev^2 = 0.49 * 1.5 = 0.735; mean = 0.3 (1 - 0.091875) + (-1.2)(1 + 0.245)(-0.15)
    assert mean == pytest.approx(0.3 * (1 - 0.735 / 1.2 * 0.15) + 1.2 * 1.245 * 0.15)
    assert out.mean.item() == pytest.approx(0.2724375 + 0.2241, abs=1e-6)  # = 0.4965375


def test_flow_grpo_sigma_one_substitutes_only_the_denominator():
    # at sigma = 1, g = a sqrt(1 / (1 - sigma_1)) and |dt| = 1 - sigma_1, so the transition std is exactly a
    s1 = 0.9
    out = flow_grpo_sde_step(t(X), t(V), 1.0, s1, noise_level=0.7, sigma_at_one=s1, noise=t(0.0))
    assert out.std.item() == pytest.approx(0.7, rel=1e-6)
    assert torch.isfinite(out.log_prob).all()


def test_flow_grpo_first_step_std_is_a_on_the_shifted_grid():
    # T = 10, shift 3: sigma_1 = 3 * 0.9 / (1 + 2 * 0.9) = 0.964286; the earlier form a sqrt(sigma_1) gave 0.687
    sig = static_shift_sigmas(10, 3.0)
    assert float(sig[1]) == pytest.approx(2.7 / 2.8, rel=1e-6)
    x = torch.zeros(1, 3, 2, 2)
    out = flow_grpo_sde_step(x, x, float(sig[0]), float(sig[1]), noise_level=0.7, sigma_at_one=float(sig[1]),
                             noise=torch.zeros_like(x))
    assert out.std.item() == pytest.approx(0.700, abs=1e-6)
    assert 0.7 * math.sqrt(float(sig[1])) == pytest.approx(0.687, abs=1e-3)  # the value the old kernel gave


def test_dance_sde_matches_formula():
    eta = 0.3
    dt = S_NEXT - S
    x0 = X - S * V
    score = -(X - (1 - S) * x0) / S**2
    mean = X + dt * V + (-0.5 * eta**2 * score) * dt
    std = eta * math.sqrt(S - S_NEXT)
    out = dance_sde_step(t(X), t(V), S, S_NEXT, eta=eta, noise=t(EPS))
    assert out.mean.item() == pytest.approx(mean, rel=1e-6)
    assert out.std.item() == pytest.approx(std, rel=1e-6)
    assert out.log_prob.item() == pytest.approx(logn(mean + std * EPS, mean, std), rel=1e-5)


def test_cps_matches_formula_and_published_logprob():
    a = 0.8
    x0, x1 = X - S * V, X + (1 - S) * V
    std = S_NEXT * math.sin(a * math.pi / 2)
    mean = x0 * (1 - S_NEXT) + x1 * math.sqrt(S_NEXT**2 - std**2)
    out = cps_step(t(X), t(V), S, S_NEXT, noise_level=a, noise=t(EPS))
    assert out.mean.item() == pytest.approx(mean, rel=1e-6)
    assert out.std.item() == pytest.approx(std, rel=1e-6)
    assert out.log_prob.item() == pytest.approx(logn(mean + std * EPS, mean, std), rel=1e-5)
    pub = cps_step(t(X), t(V), S, S_NEXT, noise_level=a, noise=t(EPS), published_log_prob=True)
    assert pub.log_prob.item() == pytest.approx(-((std * EPS) ** 2), rel=1e-5)


def test_logprob_is_mean_over_elements_and_sum_option():
    x = torch.randn(2, 3, 4, 4)
    m = torch.randn(2, 3, 4, 4)
    s = torch.full((2, 1, 1, 1), 0.3)
    lp_mean = gaussian_log_prob(x, m, s)
    lp_sum = gaussian_log_prob(x, m, s, reduce="sum")
    assert lp_mean.shape == (2,)
    assert torch.allclose(lp_sum, lp_mean * 48, rtol=1e-5)


def test_prev_sample_scoring_equals_sampling_logprob():
    x, v = torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4)
    noise = torch.randn(3, 2, 4, 4)
    sigma = torch.tensor([0.9, 0.5, 0.2])  # per-sample sigmas
    a = flow_grpo_sde_step(x, v, sigma, sigma - 0.1, 0.7, noise=noise)
    b = flow_grpo_sde_step(x, v, sigma, sigma - 0.1, 0.7, prev_sample=a.sample)
    assert torch.equal(a.log_prob, b.log_prob)
    # a row with a per-sample sigma equals the same row computed alone
    c = flow_grpo_sde_step(x[1:2], v[1:2], 0.5, 0.4, 0.7, noise=noise[1:2])
    assert torch.allclose(c.sample, a.sample[1:2], atol=1e-6)


def test_cps_published_log_prob_is_reachable_from_the_config(tiny_adapter, tmp_path):
    """sampler.cps_log_prob=published: the rollout stores -(x' - mean)^2 (mean over elements), the paper's and
    Flow-GRPO's form, = 2 s^2 (log N + log s + log sqrt(2 pi)) of the same sample; and the first update's ratio is 1."""
    from flowrl.config import load_config
    from flowrl.engine import rollout
    from flowrl.sampling import kernel_options
    from flowrl.samplers import RolloutPlan, StepSpec, static_shift_sigmas

    sig = static_shift_sigmas(4, 3.0)
    plan = RolloutPlan([StepSpec(sde=True, trained=True) for _ in range(4)], roots_per_prompt=2)
    cond = tiny_adapter.encode_prompts(["a cat"])
    trees = {}
    for mode in ("gaussian", "published"):
        cfg = load_config(None, ["sampler.kernel=cps", f"sampler.cps_log_prob={mode}"])
        trees[mode] = rollout(tiny_adapter, cond, plan, sig, (3, 16, 16), kernel="cps", noise_level=0.8,
                              generator=torch.Generator().manual_seed(0), kernel_options=kernel_options(cfg))
    for r in range(1, 4):  # the last step lands on sigma = 0, where CPS has no density
        s = float(sig[r]) * math.sin(0.8 * math.pi / 2)  # CPS std of the step into round r
        gauss, pub = trees["gaussian"].log_prob[r].double(), trees["published"].log_prob[r].double()
        assert torch.equal(trees["gaussian"].latents[r], trees["published"].latents[r])
        expect = 2 * s * s * (gauss + math.log(s) + 0.5 * math.log(2 * math.pi))
        assert torch.allclose(pub, expect, rtol=1e-4, atol=1e-7) and (pub <= 0).all()
    from flowrl.trainer import Trainer

    trainer = Trainer(load_config(None, [f"log.output_dir={tmp_path}", "log.progress=false", "sampler.kernel=cps",
                                         "sampler.cps_log_prob=published", "sampler.num_steps=4",
                                         "train.prompts_per_iter=1", "log.sample_every=0", "log.save_every=0"]))
    assert trainer.iteration(0)["ratio_max_abs_dev_first_update"] < 1e-5


def test_flow_grpo_kl_normalisation_option():
    """train.kl_std=flow_grpo divides by the std without sqrt(|dt|): the KL is |dt| times ours, so a published
    Flow-GRPO beta carries over unchanged."""
    from flowrl.losses import gaussian_kl_same_std, kl_std

    g = torch.Generator().manual_seed(0)
    x, v, v_ref = (torch.randn(2, 3, 4, 4, generator=g) for _ in range(3))
    s, s_next = torch.tensor([0.8, 0.5]), torch.tensor([0.6, 0.45])
    out = flow_grpo_sde_step(x, v, s, s_next, noise_level=0.7, noise=torch.zeros_like(x))
    ref = flow_grpo_sde_step(x, v_ref, s, s_next, noise_level=0.7, noise=torch.zeros_like(x))
    ours = gaussian_kl_same_std(out.mean, ref.mean, kl_std("transition", out.std, s, s_next))
    theirs = gaussian_kl_same_std(out.mean, ref.mean, kl_std("flow_grpo", out.std, s, s_next))
    assert torch.allclose(theirs, ours * (s - s_next), rtol=1e-5)
    # the std it divides by is the kernel's g = a sqrt(sigma / (1 - sigma)): 0.7 * 2 = 1.4 at sigma = 0.8
    assert kl_std("flow_grpo", out.std, s, s_next).flatten(1)[:, 0].tolist() == pytest.approx([1.4, 0.7], rel=1e-5)


def test_flow_grpo_kl_normalisation_rejects_cps():
    from flowrl.config import load_config
    from flowrl.errors import ConfigError

    with pytest.raises(ConfigError, match="the cps kernel's std has no sqrt"):
        load_config(None, ["sampler.kernel=cps", "train.kl_beta=0.01", "train.kl_std=flow_grpo"])


@pytest.mark.parametrize("kernel", [flow_grpo_sde_step, dance_sde_step])
def test_lowpass_noise_at_full_rank_is_the_full_kernel(kernel):
    """Keeping all H x W DCT frequencies restricts nothing: the same sample, mean and log-prob as the plain kernel."""
    g = torch.Generator().manual_seed(0)
    x, v, n = (torch.randn(2, 3, 6, 6, generator=g) for _ in range(3))
    full = kernel(x, v, S, S_NEXT, noise=n)
    lp = kernel(x, v, S, S_NEXT, noise=n, lowpass=6)
    for a, b in ((full.sample, lp.sample), (full.mean, lp.mean), (full.log_prob, lp.log_prob)):
        assert torch.allclose(a, b, atol=1e-5)


def test_lowpass_noise_by_hand():
    """k = 1 on a 2 x 2 latent: the only direction is the constant image (DCT row 1/sqrt(2), 1/sqrt(2) per axis),
    so the noise and the SDE's drift correction reach every pixel as their pixel mean, the rest is the ODE step,
    and the action is one coordinate c = sum(sample - mean) / 2 with density N(0, std^2)."""
    a = 0.7
    xs, vs, ns = [0.3, -0.1, 0.5, 0.2], [-1.2, 0.4, 0.0, 0.8], [0.5, -1.0, 2.0, 0.3]
    x, v, n = (torch.tensor(z).reshape(1, 1, 2, 2) for z in (xs, vs, ns))
    out = flow_grpo_sde_step(x, v, S, S_NEXT, noise_level=a, noise=n, lowpass=1)
    dt = S_NEXT - S
    std_dev = a * math.sqrt(S / (1 - S))
    std = std_dev * math.sqrt(-dt)
    ode = [xi + dt * vi for xi, vi in zip(xs, vs)]
    sde = [xi * (1 + std_dev**2 / (2 * S) * dt) + vi * (1 + std_dev**2 * (1 - S) / (2 * S)) * dt for xi, vi in zip(xs, vs)]
    shift = sum(s - o for s, o in zip(sde, ode)) / 4  # the correction's projection: its pixel mean
    mean = [o + shift for o in ode]
    sample = [m + std * sum(ns) / 4 for m in mean]
    c = sum(s - m for s, m in zip(sample, mean)) / 2  # = std * sum(ns) / 2 = std * 0.9
    assert out.mean.flatten().tolist() == pytest.approx(mean, rel=1e-5)
    assert out.sample.flatten().tolist() == pytest.approx(sample, rel=1e-5)
    assert c == pytest.approx(std * 0.9)
    assert out.log_prob.item() == pytest.approx(logn(c, 0.0, std), rel=1e-5)
    # scoring the stored sample gives the same log-prob, and a sample off the subspace scores only its projection
    again = flow_grpo_sde_step(x, v, S, S_NEXT, noise_level=a, prev_sample=out.sample, lowpass=1)
    assert again.log_prob.item() == pytest.approx(out.log_prob.item(), rel=1e-6)
    # the policy gradient reaches the velocity only in the explored direction: equal on all four pixels,
    # d log p / d v = (c / std^2) * (d c / d v) with d c / d v_i = (dt / 2) (1 + std_dev^2 (1 - S) / (2 S)), over 1 coordinate
    v_grad = v.clone().requires_grad_(True)
    flow_grpo_sde_step(x, v_grad, S, S_NEXT, noise_level=a, prev_sample=out.sample, lowpass=1).log_prob.sum().backward()
    expect = c / std**2 * dt / 2 * (1 + std_dev**2 * (1 - S) / (2 * S))
    assert v_grad.grad.flatten().tolist() == pytest.approx([expect] * 4, rel=1e-4)
    off = out.sample + torch.tensor([1.0, -1.0, -1.0, 1.0]).reshape(1, 1, 2, 2)  # the highest frequency only
    assert flow_grpo_sde_step(x, v, S, S_NEXT, noise_level=a, prev_sample=off, lowpass=1).log_prob.item() == \
        pytest.approx(out.log_prob.item(), rel=1e-5)


def test_lowpass_noise_from_the_config(tiny_adapter, tmp_path):
    """sampler.noise_lowpass reaches the rollout (every SDE step's residual lies in the k x k subspace, and its
    high frequencies are the ODE step's) and the update (ratio 1 on the first update); a k above the latent's side
    or the cps kernel is refused in one line."""
    from flowrl.config import load_config, validate
    from flowrl.engine import rollout
    from flowrl.sampling import kernel_options
    from flowrl.errors import ConfigError
    from flowrl.samplers import RolloutPlan, StepSpec
    from flowrl.samplers.kernels import lowpass_project
    from flowrl.trainer import Trainer

    sig = static_shift_sigmas(4, 3.0)
    plan = RolloutPlan([StepSpec(sde=True, trained=True) for _ in range(4)], roots_per_prompt=2)
    cond = tiny_adapter.encode_prompts(["a cat"])
    options = kernel_options(load_config(None, ["sampler.noise_lowpass=4"]))
    assert options == {"lowpass": 4, "lowpass_skip_dc": False}
    tree = rollout(tiny_adapter, cond, plan, sig, (3, 16, 16), kernel="flow_grpo", noise_level=0.7,
                   generator=torch.Generator().manual_seed(0), kernel_options=options, store_mean=True)
    for r in range(1, 4):
        resid = tree.latents[r] - tree.mean[r]  # (2, 3, 16, 16)
        assert resid.abs().max() > 1e-3  # noise was drawn ...
        assert torch.allclose(lowpass_project(resid, 4), resid, atol=1e-5)  # ... only in the 4 x 4 lowest frequencies

    base = [f"log.output_dir={tmp_path}", "log.progress=false", "sampler.num_steps=4", "train.prompts_per_iter=1",
            "log.sample_every=0", "log.save_every=0"]
    trainer = Trainer(load_config(None, base + ["sampler.noise_lowpass=4"]))
    assert trainer.iteration(0)["ratio_max_abs_dev_first_update"] < 1e-5
    with pytest.raises(ConfigError, match="noise_lowpass=99"):
        Trainer(load_config(None, base + ["sampler.noise_lowpass=99", "log.run_name=too-wide"]))
    with pytest.raises(ConfigError, match="cps kernel"):
        validate(load_config(None, ["sampler.noise_lowpass=4", "sampler.kernel=cps"]))
    with pytest.raises(ConfigError, match="at least 2"):
        validate(load_config(None, ["sampler.noise_lowpass_skip_dc=true"]))


def test_lowpass_noise_without_the_constant_term():
    """noise_lowpass_skip_dc: the residual keeps each channel's pixel mean at the ODE step's (no global colour
    shift), still lies in the k x k subspace, and the action has k^2 - 1 coordinates per channel."""
    from flowrl.samplers.kernels import lowpass_coords, lowpass_project

    g = torch.Generator().manual_seed(1)
    x, v, n = (torch.randn(2, 3, 8, 8, generator=g) for _ in range(3))
    out = flow_grpo_sde_step(x, v, S, S_NEXT, noise=n, lowpass=3, lowpass_skip_dc=True)
    ode = ode_step(x, v, S, S_NEXT).sample
    resid = out.sample - out.mean
    assert torch.allclose(resid.mean(dim=(-2, -1)), torch.zeros(2, 3), atol=1e-6)
    assert torch.allclose((out.mean - ode).mean(dim=(-2, -1)), torch.zeros(2, 3), atol=1e-6)
    assert torch.allclose(lowpass_project(resid, 3), resid, atol=1e-5) and resid.abs().max() > 1e-2
    coords = lowpass_coords(resid, 3, skip_dc=True)  # (2, 3, 8)
    assert coords.shape == (2, 3, 8)
    expect = (-coords**2 / (2 * out.std.flatten(-2) ** 2) - torch.log(out.std.flatten(-2)) - 0.5 * math.log(2 * math.pi))
    assert torch.allclose(out.log_prob, expect.mean(dim=(1, 2)), atol=1e-5)
