"""Step kernels, sigma schedules and rollout plans (installed as ``flowrl.samplers``)."""

from .kernels import StepOutput, cps_step, dance_sde_step, flow_grpo_sde_step, gaussian_log_prob, ode_step, step
from .plans import RolloutPlan, StepSpec
from .schedules import diffusers_sigmas, dynamic_shift_sigmas, make_sigmas, static_shift_sigmas

__all__ = [
    "StepOutput",
    "cps_step",
    "dance_sde_step",
    "flow_grpo_sde_step",
    "gaussian_log_prob",
    "ode_step",
    "step",
    "RolloutPlan",
    "StepSpec",
    "diffusers_sigmas",
    "dynamic_shift_sigmas",
    "make_sigmas",
    "static_shift_sigmas",
]
