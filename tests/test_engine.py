"""The rollout engine: parity with diffusers, batching invariance, tree accounting."""

import random

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from flowrl.samplers import RolloutPlan, StepSpec, make_sigmas

from flowrl.algorithms import make_algorithm
from flowrl.engine import rollout

from .conftest import make_cfg

PROMPTS = ["a red circle on a blue background", "a green square on a white background"]


def test_ode_rollout_equals_diffusers_scheduler(tiny_adapter):
    """With noise off, our loop equals FlowMatchEulerDiscreteScheduler stepping the same model."""
    a = tiny_adapter
    steps = 6
    sched = FlowMatchEulerDiscreteScheduler.from_config(a.pipe.scheduler.config)
    sched.set_timesteps(steps)
    shape = a.latent_shape(16)
    noise = torch.randn((2, *shape), generator=torch.Generator().manual_seed(0))
    cond = a.encode_prompts(PROMPTS)
    x = noise.clone()
    with torch.no_grad():
        for t in sched.timesteps:
            v = a.transformer(hidden_states=x, timestep=t.expand(2), encoder_hidden_states=cond.embeds,
                              pooled_projections=cond.pooled, return_dict=False)[0]
            x = sched.step(v, t, x, return_dict=False)[0]
    sigmas = make_sigmas("diffusers", steps, scheduler_config=dict(a.pipe.scheduler.config))
    plan = RolloutPlan([StepSpec(sde=False) for _ in range(steps)])
    tree = rollout(a, cond, plan, sigmas, shape, kernel="flow_grpo", noise_level=0.7,
                   generator=torch.Generator(), initial_noise=noise)
    assert torch.allclose(tree.leaves, x, atol=1e-5), (tree.leaves - x).abs().max()


def test_batched_rollout_equals_one_node_per_call(tiny_adapter, tmp_path):
    cfg = make_cfg(tmp_path, "algorithm.group_size=3", "sampler.num_steps=4", "sampler.schedule=static_shift")
    plan = make_algorithm(cfg).plan(0)
    sig = make_sigmas("static_shift", 4, 3.0)
    cond = tiny_adapter.encode_prompts(PROMPTS)
    shape = tiny_adapter.latent_shape(16)
    kw = dict(kernel="flow_grpo", noise_level=0.7)
    t1 = rollout(tiny_adapter, cond, plan, sig, shape, generator=torch.Generator().manual_seed(5), max_batch=64, **kw)
    t2 = rollout(tiny_adapter, cond, plan, sig, shape, generator=torch.Generator().manual_seed(5), max_batch=1, **kw)
    assert t1.transformer_calls == 4 and t2.transformer_calls == 4 * 6
    assert t1.nfe == t2.nfe == 24
    assert torch.allclose(t1.leaves, t2.leaves, atol=1e-5)
    assert torch.allclose(torch.stack(t1.log_prob[1:]), torch.stack(t2.log_prob[1:]), atol=1e-4)


def test_dance_shared_noise_is_one_root_branching_g(tiny_adapter, tmp_path):
    cfg = make_cfg(tmp_path, "algorithm.name=dance_grpo", "algorithm.shared_noise=true", "algorithm.group_size=4",
                   "sampler.num_steps=5", "sampler.kernel=dance", "sampler.noise_level=0.3",
                   "algorithm.timestep_selection=random", "algorithm.timestep_fraction=0.5")
    plan = make_algorithm(cfg).plan(0)
    assert plan.roots_per_prompt == 1 and plan.steps[0].branch == 4
    assert plan.counts()["nfe"] == 1 + 4 * 4  # the shared root is evaluated once
    assert plan.leaves_per_prompt == 4
    cond = tiny_adapter.encode_prompts(PROMPTS)
    tree = rollout(tiny_adapter, cond, plan, make_sigmas("static_shift", 5, 3.0), tiny_adapter.latent_shape(16),
                   kernel="dance", noise_level=0.3, generator=torch.Generator().manual_seed(0))
    assert tree.nfe == 2 * 17
    # all four children of a root share the parent latent but differ after the SDE step
    assert torch.equal(tree.parent[1], torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]))
    assert not torch.allclose(tree.latents[1][0], tree.latents[1][1])
    # random per-path selection: each leaf path trains int(4 * 0.5) = 2 of the 4 candidate steps (last excluded)
    masks = make_algorithm(cfg).select_edges(tree, torch.Generator().manual_seed(0))
    per_leaf = sum(m.long() for m in masks[1:])
    assert per_leaf.tolist() == [2] * 8
    assert not masks[5].any()


def test_antithetic_siblings_mirror_the_shared_step(tiny_adapter, tmp_path):
    """algorithm.antithetic: the G children of a shared root take mirrored SDE noises (sibling b and b + G/2), so
    each pair's samples sit symmetrically about their common mean and have equal log-probs; in the low-pass kernel
    too (the projection is linear)."""
    import pytest

    from flowrl.sampling import kernel_options
    from flowrl.errors import ConfigError

    for lowpass in (0, 4):
        cfg = make_cfg(tmp_path, "algorithm.name=flow_grpo_fast", "algorithm.shared_noise=true",
                       "algorithm.antithetic=true", "algorithm.group_size=4", "algorithm.window.size=1",
                       "sampler.num_steps=4", f"sampler.noise_lowpass={lowpass}")
        plan = make_algorithm(cfg).plan(0)
        assert plan.steps[0].branch == 4 and plan.steps[0].sibling_noise == "antithetic"
        tree = rollout(tiny_adapter, tiny_adapter.encode_prompts(PROMPTS), plan, make_sigmas("static_shift", 4, 3.0),
                       tiny_adapter.latent_shape(16), kernel="flow_grpo", noise_level=0.7,
                       generator=torch.Generator().manual_seed(0), kernel_options=kernel_options(cfg))
        x1 = tree.latents[1].view(2, 2, 2, -1)  # (prompt, mirrored half, sibling in the half, latent)
        pair_sums = x1[:, 0] + x1[:, 1]  # = 2 x the siblings' shared SDE mean, for every pair
        assert torch.allclose(pair_sums[:, 0], pair_sums[:, 1], atol=1e-5)
        assert not torch.allclose(x1[:, 0], x1[:, 1], atol=1e-3)
        lp = tree.log_prob[1].view(2, 2, 2)
        assert torch.allclose(lp[:, 0], lp[:, 1], atol=1e-5)
        assert not torch.allclose(lp[:, :, 0], lp[:, :, 1], atol=1e-5)  # the two pairs are different draws
    with pytest.raises(ConfigError, match="algorithm.antithetic: .* set algorithm.shared_noise=true"):
        make_cfg(tmp_path, "algorithm.antithetic=true", "algorithm.shared_noise=false")
    with pytest.raises(ConfigError, match="algorithm.group_size=5 must be even"):
        make_cfg(tmp_path, "algorithm.antithetic=true", "algorithm.shared_noise=true", "algorithm.group_size=5")


def test_mix_window_plans(tmp_path):
    cfg = make_cfg(tmp_path, "algorithm.name=mix_grpo", "sampler.num_steps=10", "algorithm.window.size=3",
                   "algorithm.window.placement=progressive", "algorithm.window.iters_per_shift=2",
                   "algorithm.window.stride=2", "algorithm.shared_noise=true", "algorithm.group_size=4",
                   "algorithm.window.near_end=full", "algorithm.window.range_end=-1")
    starts = [make_algorithm(cfg).plan(it).notes["window_start"] for it in range(12)]
    # last start = 9 - 3 = 6; positions 0, 2, 4, 6 then roll back
    assert starts == [0, 0, 2, 2, 4, 4, 6, 6, 0, 0, 2, 2]
    plan = make_algorithm(cfg).plan(2)
    assert [s.sde for s in plan.steps] == [False, False, True, True, True, False, False, False, False, False]
    assert [s.trained for s in plan.steps] == [s.sde for s in plan.steps]
    assert plan.steps[2].branch == 4 and plan.roots_per_prompt == 1  # shared ODE prefix, branch at the window
    assert plan.counts()["nfe"] == 3 + 4 * 7  # depths 0-2: one node; depths 3-9: four
    # MixGRPO's code: starts run on to T - 2 = 8, the window is cut before step 8, then empty, then back to 0
    cfg_c = make_cfg(tmp_path, "algorithm.name=mix_grpo", "sampler.num_steps=10", "algorithm.window.size=4",
                     "algorithm.window.iters_per_shift=1", "algorithm.group_size=4")
    windows = []
    for it in range(11):
        plan = make_algorithm(cfg_c).plan(it)
        windows.append([i for i, s in enumerate(plan.steps) if s.trained])
    assert windows == [[0, 1, 2, 3], [1, 2, 3, 4], [2, 3, 4, 5], [3, 4, 5, 6], [4, 5, 6, 7], [5, 6, 7], [6, 7], [7],
                       [], [0, 1, 2, 3], [1, 2, 3, 4]]
    empty = make_algorithm(cfg_c).plan(8)
    assert empty.roots_per_prompt == 1 and not any(s.sde for s in empty.steps)  # one ODE sample per prompt
    cfg_r = make_cfg(tmp_path, "algorithm.name=flow_grpo_fast", "algorithm.window.size=2",
                     "algorithm.window.placement=random", "algorithm.window.range_start=0", "algorithm.window.range_end=5")
    seen = {make_algorithm(cfg_r).plan(it, random.Random(it)).notes["window_start"] for it in range(50)}
    assert seen == {0, 1, 2, 3}


def test_flat_presets_take_a_window(tmp_path):
    """window.size > 0 on flow_grpo / dance_grpo / chunk_grpo / superflow: only the window is SDE and trained."""
    own = {"flow_grpo": ["algorithm.group_size=4"], "dance_grpo": ["algorithm.group_size=4"],
           "chunk_grpo": ["algorithm.group_size=4", "algorithm.sizes=[1, 1]"], "superflow": []}
    for name, extra in own.items():  # each algorithm accepts only its own options
        cfg = make_cfg(tmp_path, f"algorithm.name={name}", "sampler.num_steps=6", "algorithm.window.size=2",
                       "algorithm.window.start=1", *extra)
        plan = make_algorithm(cfg).plan(0)
        assert [s.sde for s in plan.steps] == [False, True, True, False, False, False], name
        assert [s.trained for s in plan.steps] == [s.sde for s in plan.steps], name
    # without a window they stay all-SDE (flow_grpo trains the first int(T * 0.99) = 5 of 6 steps)
    plan = make_algorithm(make_cfg(tmp_path, "sampler.num_steps=6")).plan(0)
    assert all(s.sde for s in plan.steps) and [s.trained for s in plan.steps] == [True] * 5 + [False]
    # dance_grpo's random subset is drawn inside the window: int(2 * 0.5) = 1 of the 2 window steps per path
    cfg = make_cfg(tmp_path, "algorithm.name=dance_grpo", "sampler.num_steps=6", "algorithm.window.size=2",
                   "algorithm.window.start=1", "algorithm.group_size=4", "algorithm.timestep_selection=random",
                   "algorithm.timestep_fraction=0.5")
    assert make_algorithm(cfg).plan(0).steps[1].sde and not make_algorithm(cfg).plan(0).steps[0].sde
