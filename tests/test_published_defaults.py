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


# ------------------------------------------------------------------------------------------------ DGPO
def _dgpo(*overrides):
    from flowrl.algorithms import make_algorithm
    from flowrl.config import load_config

    return make_algorithm(load_config("configs/tiny_shapes_dgpo.yaml", list(overrides)))


def test_dgpo_draws_its_training_sigmas_from_0_to_trunc_steps_inclusive():
    """The published rule: k indices without replacement from range(trunc_steps + 1), one draw per iteration."""
    algo = _dgpo("algorithm.trunc_steps=6", "algorithm.timesteps_per_sample=4")
    sigmas = torch.linspace(1, 0, 11)  # a 10-step grid
    seen = set()
    for seed in range(40):
        ours = algo.training_timesteps(3, sigmas, torch.Generator().manual_seed(seed))
        published = torch.randperm(6 + 1, generator=torch.Generator().manual_seed(seed))[:4]
        assert torch.equal(ours, sigmas[published].unsqueeze(0).expand(3, -1))
        seen |= set(published.tolist())
    assert seen == set(range(7))  # index 6 is drawn (the pool was one short before)


def test_dgpo_s_fast_ema_follows_every_optimizer_step_and_draws_rollouts_after_the_switch():
    """ema <- d ema + (1 - d) theta after every optimizer step s = 0, 1, ... with d = min(0.3, 0.001 s), from the
    first step; the rollouts use it once more than switch_ema_ref steps are done (the code samples with the EMA
    when ``global_step > switch_ema_ref``); the count survives a resume."""
    algo = _dgpo("algorithm.switch_ema_ref=3")
    decays = []

    class Policy:
        def follow_old(self, decay):
            decays.append(decay)

    sampled = []
    for _ in range(5):
        sampled.append(algo.samples_with_old_policy(0))
        algo.follow_fast_ema(Policy())
    assert decays == [min(0.3, 0.001 * s) for s in range(5)] and sampled == [False, False, False, False, True]
    assert algo.old_decay(7) == 1.0  # nothing more at the iteration's end
    resumed = _dgpo("algorithm.switch_ema_ref=3")
    resumed.load_state_dict(algo.state_dict())
    assert resumed.optimizer_steps == 5 and resumed.samples_with_old_policy(0)
    for s in (299, 300, 301, 5000):
        resumed.optimizer_steps = s
        resumed.follow_fast_ema(Policy())
        assert decays[-1] == min(0.3, 0.001 * s)


def test_dgpo_s_pickscore_preset_is_the_published_pickscore_config():
    """The published PickScore config keeps the base clip 0.05 and groups of 24 (0.01 is its GenEval / OCR clip)."""
    from flowrl.config import load_config

    cfg = load_config("configs/sd35m_dgpo.yaml", [])
    a = cfg.algorithm
    assert (a.group_size, a.clip_range, a.dpo_beta, a.trunc_steps, a.timesteps_per_sample, a.switch_ema_ref) == \
        (24, 0.05, 10.0, 6, 4, 200)
    assert (cfg.train.kl_beta, cfg.train.lr, cfg.train.cfg, cfg.sampler.num_steps) == (0.001, 3e-4, False, 10)
    from flowrl.algorithms.dgpo import DGPOOptions

    assert DGPOOptions.model_fields["clip_range"].default == 0.05  # the code's base value


def test_sft_keeps_every_sample_tied_at_its_group_s_best():
    """The published rule: within a prompt's group, every sample whose reward equals the maximum is kept."""
    from flowrl.algorithms.sft import keep_indicator

    rewards = torch.tensor([1.0, 3.0, 3.0, 2.0, 0.5, float("nan"), 0.5, 0.25])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    published = torch.zeros(8)
    for g in (0, 1):
        members = [i for i in range(8) if groups[i] == g and rewards[i] == rewards[i]]
        best = max(rewards[i].item() for i in members)
        for i in members:
            published[i] = float(rewards[i].item() == best)
    assert keep_indicator(rewards, groups, "best").tolist() == published.tolist() == [0, 1, 1, 0, 1, 0, 1, 0]


def test_online_dpo_and_sft_draw_logit_normal_sigmas_on_the_training_scheduler():
    """Flow-GRPO's DPO / SFT scripts: u = sigmoid(randn), index = int(u * 1000) into the training scheduler's
    timesteps; compared with diffusers' FlowMatchEulerDiscreteScheduler(shift=3) itself."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from flowrl.algorithms.forward_process import logit_normal_sigmas

    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    ours = logit_normal_sigmas(4, 3, 3.0, torch.Generator().manual_seed(5))
    u = torch.sigmoid(torch.randn(4, 3, generator=torch.Generator().manual_seed(5), dtype=torch.float64))
    published = scheduler.timesteps[(u * 1000).long().flatten()].view(4, 3) / 1000
    assert torch.allclose(ours, published.float(), atol=1e-6)
    for name in ("online_dpo", "sft"):
        from flowrl.algorithms import make_algorithm
        from flowrl.config import load_config

        algo = make_algorithm(load_config(None, [f"algorithm.name={name}", "algorithm.group_size=2"]))
        assert algo.opts.time_type == "logit_normal"
        algo.training_shift = 3.0
        drawn = algo.training_timesteps(4, torch.linspace(1, 0, 11), torch.Generator().manual_seed(5))
        k = algo.opts.timesteps_per_sample
        assert torch.equal(drawn, logit_normal_sigmas(4, k, 3.0, torch.Generator().manual_seed(5)))
        assert not torch.isin(drawn, torch.linspace(1, 0, 11)).all()  # continuous, not the rollout grid


def test_gardo_resets_when_any_optimizer_step_passes_the_threshold(tmp_path):
    """The published rule checks the KL after every optimizer step: one step above the threshold resets the
    reference even when the iteration's mean is below it. kl_loss_step_max is the largest step's mean KL, measured
    here with two minibatches (two optimizer steps)."""
    from tests.conftest import make_cfg

    from flowrl.trainer import Trainer

    cfg = make_cfg(tmp_path, "algorithm.name=gardo", "algorithm.group_size=4", "sampler.num_steps=4",
                   "train.prompts_per_iter=2", "train.kl_beta=0.04", "train.num_minibatches=2", "train.lr=1e-2",
                   "rewards=[{name: jpeg_incompressibility}, {name: 'tests.helpers:brightness'}]")
    trainer = Trainer(cfg)
    row = trainer.iteration(0)
    assert row["kl_loss_step_max"] >= row["kl_loss"] - 1e-12 and row["optimizer_steps"] == 2
    algo, threshold = trainer.algorithm, trainer.algorithm.opts.kl_threshold
    algo.since_reset = 0
    stats = {"kl_loss": threshold / 2, "kl_loss_step_max": threshold * 2}
    algo.observe_update(stats)
    assert stats["gardo_reference_reset"] == 1.0
    stats = {"kl_loss": threshold / 2, "kl_loss_step_max": threshold / 2}
    algo.observe_update(stats)
    assert stats["gardo_reference_reset"] == 0.0


def test_euphonium_normalises_the_gradient_per_sample_as_the_published_sampler_calls_it():
    """Pixel-space tiny model and the mean-pixel reward: g = 1 / (2 n) on each of 2 x n elements. The published
    sampler calls its guided step one sample at a time, so its g / ||g|| is per sample: 1 / sqrt(n) (``sample``);
    ``batch``: 1 / sqrt(2 n); the shift is lambda (sigma - sigma_next) times that."""
    from tests.test_reward_gradient import guided_pixel_step

    n = 3 * 32 * 32
    for mode, per_element in (("batch", 1 / (2 * n) ** 0.5), ("sample", 1 / n ** 0.5), ("none", 1 / (2 * n))):
        _, shift, _ = guided_pixel_step(f"algorithm.normalize_gradient={mode}")
        assert torch.allclose(shift, torch.full_like(shift, 2.0 * 0.2 * per_element), rtol=1e-5), mode


def test_every_algorithm_s_config_runs_the_universal_checks():
    """validate() runs the universal checks before each algorithm's own check, and no algorithm overrides it: an
    algorithm without a PPO ratio refuses GRPO-Guard at config load whatever its check() does."""
    from flowrl.config import load_config
    from flowrl.errors import ConfigError
    from flowrl.registry import ALGORITHMS

    refusing = 0
    for name in ALGORITHMS.names():
        cls = ALGORITHMS.resolve(name)
        assert "validate" not in vars(cls), name
        if not cls.refuses_grpo_guard:
            continue
        refusing += 1
        with pytest.raises(ConfigError, match="train.grpo_guard"):
            load_config(None, [f"algorithm.name={name}", "train.grpo_guard=true"])
    assert refusing >= 6  # the forward-process methods and reward backpropagation


@pytest.mark.parametrize("name, kept, source", [
    ("flow_grpo", False, "Flow-GRPO's training block computes the unconditional half without autograd"),
    ("dance_grpo", False, "declares nothing: the package default, Flow-GRPO's choice"),
    ("gardo", True, "train_sd3_grpo_gardo.py, compute_log_prob: both halves in the graph"),
    ("tempflow_grpo", True, "scripts/train_sd3_pr.py: both halves in the graph"),
])
def test_the_cfg_gradient_default_is_each_method_s_published_choice(name, kept, source):
    """train.cfg_unconditional_grad left out: the method's published value; set: the config's."""
    from flowrl.config import load_config

    base = {"gardo": "configs/sd35m_gardo.yaml", "tempflow_grpo": "configs/sd35m_tempflow_grpo.yaml"}.get(
        name, "configs/sd35m_flow_grpo.yaml")
    cfg = load_config(base, [] if name in ("gardo", "tempflow_grpo") else [f"algorithm.name={name}"])
    assert cfg.train.cfg_unconditional_grad is kept, source
    flipped = load_config(base, [f"train.cfg_unconditional_grad={str(not kept).lower()}"]
                          + ([] if name in ("gardo", "tempflow_grpo") else [f"algorithm.name={name}"]))
    assert flipped.train.cfg_unconditional_grad is (not kept)


# every registered method's CFG-gradient choice and where it comes from; a new method must be added here
CFG_GRADIENT = {
    "flow_grpo": (False, "Flow-GRPO scripts/train_sd3.py: noise_pred_uncond.detach() in the training forward"),
    "flow_grpo_fast": (False, "Flow-GRPO's training block (the same script with the window)"),
    "mix_grpo": (False, "built on Flow-GRPO-Fast's update"),
    "gardo": (True, "train_sd3_grpo_gardo.py, compute_log_prob: both halves in the graph"),
    "tempflow_grpo": (True, "scripts/train_sd3_pr.py: both halves in the graph"),
}
NOT_READ = "no published choice read: the package default, Flow-GRPO's (detached)"


def test_every_method_declares_its_cfg_gradient_and_explain_shows_it():
    """The per-method value is the class's declaration; `flowrl config explain` lists it; a method whose published
    code the package has not read takes Flow-GRPO's choice (detached), named as such."""
    from flowrl.config import explain, method_defaults
    from flowrl.registry import ALGORITHMS, algorithm_class

    table = method_defaults("train.cfg_unconditional_grad")
    assert set(table) == set(ALGORITHMS.names())
    for name in ALGORITHMS.names():
        kept, source = CFG_GRADIENT.get(name, (False, NOT_READ))
        assert algorithm_class(name).cfg_unconditional_grad is kept, (name, source)
        assert table[name] is kept
    text = explain("train.cfg_unconditional_grad")
    assert "true: gardo, tempflow_grpo" in text and "false: ac_flow" in text


def test_validate_returns_the_resolved_config_and_leaves_its_input_alone():
    """A method's published defaults come back in the returned config; the config handed in keeps what it said."""
    from flowrl.config import Config, load_config, validate

    base = load_config(None, ["algorithm.name=branch_grpo", "algorithm.group_size=16"])
    raw = Config.model_validate({**base.model_dump(exclude={"advantage", "train"}),
                                 "train": base.train.model_dump(exclude={"cfg_unconditional_grad"}),
                                 "algorithm": base.algorithm.model_dump()})
    raw = raw.model_copy(update={"algorithm": base.algorithm})
    out = validate(raw)
    assert (out.advantage.ddof, out.advantage.eps) == (1, 1e-8)  # BranchGRPO's released torch.std and 1e-8
    assert (raw.advantage.ddof, raw.advantage.eps) == (Config().advantage.ddof, Config().advantage.eps)
    assert "cfg_unconditional_grad" not in raw.train.model_fields_set
