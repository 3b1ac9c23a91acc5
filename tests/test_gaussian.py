"""SDE sampling on an analytic Gaussian data distribution whose velocity is known in closed form.

Data x0 ~ N(m, s^2) per element; x_sigma = (1 - sigma) x0 + sigma eps is Gaussian, so
E[x0 | x] and E[eps | x] are linear in x and v(x, sigma) = E[eps | x] - E[x0 | x] exactly.
The marginal-preserving SDEs must then reproduce N(m, s^2) up to discretisation and Monte-Carlo error.
"""

import pytest
import torch
from flowrl.samplers import make_sigmas, step

M, S = 0.5, 0.3


def exact_velocity(x: torch.Tensor, sigma: float) -> torch.Tensor:
    a = 1.0 - sigma
    var = a * a * S * S + sigma * sigma
    centered = x - a * M
    e_eps = sigma / var * centered
    e_x0 = M + a * S * S / var * centered
    return e_eps - e_x0


def sample(kernel: str, noise_level: float, steps: int, n: int = 40000, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    sigmas = make_sigmas("static_shift", steps, shift=1.0)
    x = torch.randn(n, 1, generator=g)
    for i in range(steps):
        s, s_next = float(sigmas[i]), float(sigmas[i + 1])
        out = step(kernel, x, exact_velocity(x, s), s, s_next, noise_level=noise_level,
                   sigma_at_one=float(sigmas[1]), noise=torch.randn(x.shape, generator=g))
        x = out.sample
    return x.flatten()


@pytest.mark.parametrize("kernel,level", [("flow_grpo", 0.7), ("dance", 0.3)])
def test_sde_reproduces_gaussian_mean_and_variance(kernel, level):
    x = sample(kernel, level, steps=100)
    # tolerance: Monte-Carlo error of 40k samples (std of mean ~0.0015) plus Euler-Maruyama bias at 100 steps
    assert x.mean().item() == pytest.approx(M, abs=0.01)
    assert x.var().item() == pytest.approx(S * S, rel=0.05)


def test_ode_reproduces_gaussian():
    x = sample("ode", 0.0, steps=100)
    assert x.mean().item() == pytest.approx(M, abs=0.01)
    assert x.var().item() == pytest.approx(S * S, rel=0.05)


def test_cps_keeps_the_mean_but_not_the_variance():
    """CPS re-noises by sigma_next sin(a pi/2) around the posterior-mean x0 estimate, a std that does not
    shrink with the step size, so it loses variance on non-degenerate data (measured: 0.064 vs 0.09 at a=0.7,
    no better at 1000 steps). Its mean is right. This documents a property of the method, not a defect."""
    x = sample("cps", 0.7, steps=100)
    assert x.mean().item() == pytest.approx(M, abs=0.01)
    assert 0.6 * S * S < x.var().item() < 0.8 * S * S
