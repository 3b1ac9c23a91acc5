"""MixGRPO (arXiv 2507.21802): hybrid ODE-SDE sampling with a sliding window (``window.placement:
progressive``) and, as in its code, one shared initial noise per prompt. The engine path is Flow-GRPO-Fast's;
the difference is the published code's defaults: a window of 4 that moves one step every 25 iterations from step
0, never reaches step T - 2 (``range_end: -2``), is cut short near it (``near_end: shrink``: at start T - 4 it
covers 2 steps, then 1, then none, and the next position rolls back to 0). ``near_end: full`` keeps the window's
size and stops its start where it fits instead."""

from __future__ import annotations

from pydantic import Field, field_validator

from ..config import opt
from .base import WindowedOptions, WindowOptions
from .flow_grpo_fast import FlowGRPOFast


MIX_WINDOW = {"size": 4, "placement": "progressive", "range_end": -2, "near_end": "shrink", "stride": 1,
              "iters_per_shift": 25}


class MixGRPOOptions(WindowedOptions):
    shared_noise: bool = opt(True, "all G samples of a prompt start from the same noise (MixGRPO's code)")
    window: WindowOptions = Field(default_factory=lambda: WindowOptions(**MIX_WINDOW))

    @field_validator("window", mode="before")
    @classmethod
    def _mix_defaults(cls, value):
        """Window keys a config leaves out keep MixGRPO's values, not the generic window's."""
        return {**MIX_WINDOW, **value} if isinstance(value, dict) else value


class MixGRPO(FlowGRPOFast):
    """Flow-GRPO-Fast with MixGRPO's published window and shared noise: a documented variant of Flow-GRPO-Fast."""

    variant_of = FlowGRPOFast
    Options = MixGRPOOptions
