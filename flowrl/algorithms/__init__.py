"""Algorithms, one module each. :class:`FlowGRPO` holds the default of every hook; each other module is its
algorithm's difference from it. The trainer reaches them only by name, through :mod:`flowrl.registry`."""

from __future__ import annotations

from ..registry import algorithm_class, register_algorithm
from .base import AlgorithmContext, Unit, WindowOptions
from .flow_grpo import FlowGRPO


def make_algorithm(cfg) -> FlowGRPO:
    """The algorithm object for a loaded config (its options are ``cfg.algorithm``)."""
    return algorithm_class(cfg.algorithm.name)(cfg)


__all__ = ["AlgorithmContext", "FlowGRPO", "Unit", "WindowOptions", "algorithm_class", "make_algorithm",
           "register_algorithm"]
