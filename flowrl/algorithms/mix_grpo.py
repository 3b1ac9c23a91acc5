"""MixGRPO (arXiv 2507.21802): hybrid ODE-SDE sampling with a sliding window (``window.placement:
progressive``) and, as in its code, one shared initial noise per prompt. The engine path is Flow-GRPO-Fast's;
the difference is the paper's defaults."""

from __future__ import annotations

from pydantic import Field

from ..config import opt
from .base import WindowedOptions, WindowOptions
from .flow_grpo_fast import FlowGRPOFast


class MixGRPOOptions(WindowedOptions):
    shared_noise: bool = opt(True, "all G samples of a prompt start from the same noise (MixGRPO's code)")
    window: WindowOptions = Field(default_factory=lambda: WindowOptions(size=4, placement="progressive"))


class MixGRPO(FlowGRPOFast):
    Options = MixGRPOOptions
