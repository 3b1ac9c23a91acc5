import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from flowrl.samplers import diffusers_sigmas, dynamic_shift_sigmas, static_shift_sigmas
from flowrl.samplers.schedules import dynamic_shift_mu


def test_static_shift_by_hand():
    s = static_shift_sigmas(4, shift=3.0)
    # u = 1, .75, .5, .25, 0 -> 3u / (1 + 2u)
    expected = [1.0, 2.25 / 2.5, 1.5 / 2.0, 0.75 / 1.5, 0.0]
    assert s.tolist() == pytest.approx(expected, abs=1e-7)


def test_diffusers_schedule_equals_scheduler():
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(10)
    ours = diffusers_sigmas(dict(sched.config), 10)
    assert torch.allclose(ours, sched.sigmas.float())
    assert ours[0] == 1.0 and ours[-1] == 0.0 and len(ours) == 11


def test_dynamic_shift_equals_diffusers():
    sched = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, time_shift_type="exponential")
    mu = dynamic_shift_mu(1024)
    assert mu == pytest.approx(0.5 + (1.15 - 0.5) * (1024 - 256) / (4096 - 256))
    # the FLUX / SD3.5 pipelines pass sigmas = linspace(1, 1/T, T) with mu
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / 8, 8), mu=mu)
    assert torch.allclose(dynamic_shift_sigmas(8, mu), sched.sigmas.float(), atol=1e-6)
