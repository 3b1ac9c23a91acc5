"""Flow-GRPO (arXiv 2505.05470): G independent initial noises per prompt, every step SDE, the first
int(T * timestep_fraction) steps trained (steps 0..8 of 10), group z-scored advantages, per-step PPO clip.
It is the transition kind (:class:`~flowrl.algorithms.transition.TransitionAlgorithm`) with nothing changed."""

from __future__ import annotations

from .transition import TransitionAlgorithm, TransitionOptions


class FlowGRPOOptions(TransitionOptions):
    pass


class FlowGRPO(TransitionAlgorithm):
    """Flow-GRPO: the transition kind's plan, edges, rows and PPO-clip objective, unchanged."""

    Options = FlowGRPOOptions
