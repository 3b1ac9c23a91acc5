"""Algorithms, one module each, on an abstract :class:`Algorithm` (the hooks every method has) and its two kinds:
:class:`TransitionAlgorithm` (a loss over the sampler's trained transitions) and :class:`ForwardProcessAlgorithm`
(a loss on re-noised clean samples). Each method subclasses its kind with exactly its difference; a documented
variant of another method (``variant_of``) subclasses that method. The trainer reaches them only by name, through
:mod:`flowrl.registry`."""

from __future__ import annotations

from ..registry import algorithm_class, register_algorithm
from .base import Algorithm, AlgorithmContext, Unit, WindowOptions
from .flow_grpo import FlowGRPO
from .forward_process import ForwardProcessAlgorithm
from .transition import TransitionAlgorithm, TransitionOptions


def make_algorithm(cfg) -> Algorithm:
    """The algorithm object for a loaded config (its options are ``cfg.algorithm``)."""
    return algorithm_class(cfg.algorithm.name)(cfg)


__all__ = ["Algorithm", "AlgorithmContext", "FlowGRPO", "ForwardProcessAlgorithm", "TransitionAlgorithm",
           "TransitionOptions", "Unit", "WindowOptions", "algorithm_class", "make_algorithm", "register_algorithm"]
