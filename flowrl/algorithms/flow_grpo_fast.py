"""Flow-GRPO-Fast: SDE (and training) only inside a window of ``window.size`` steps, ODE elsewhere; the
window's placement is fixed, random per iteration, or progressive. Differs from Flow-GRPO only in needing a
window (and so in having no timestep fraction)."""

from __future__ import annotations

from .base import WindowedOptions
from .flow_grpo import FlowGRPO


class FlowGRPOFast(FlowGRPO):
    """Flow-GRPO with a required SDE window: a documented variant of Flow-GRPO."""

    variant_of = FlowGRPO
    Options = WindowedOptions
    window_required = True
