"""Names -> implementations, resolved lazily by import path.

The core never imports an algorithm module, the shapes demo or a user's plug-in by module name: it asks this
registry, whose built-in entries are ``"module:attribute"`` strings imported on first use. A user plugs in their
own algorithm, prompt set or evaluator with ``register_*`` (in-process) or by giving ``module:attribute`` as the
name in a config, as rewards already allow.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from typing import Any

from .errors import ConfigError

ALGORITHMS: dict[str, Any] = {
    name: f"flowrl.algorithms.{name}:{cls}" for name, cls in [
        ("flow_grpo", "FlowGRPO"), ("flow_grpo_fast", "FlowGRPOFast"), ("mix_grpo", "MixGRPO"),
        ("dance_grpo", "DanceGRPO"), ("branch_grpo", "BranchGRPO"), ("tempflow_grpo", "TempFlowGRPO"),
        ("e_grpo", "EGRPO"), ("chunk_grpo", "ChunkGRPO"), ("superflow", "SuperFlow"), ("ada_grpo", "AdaGRPO"),
        ("diffusion_nft", "DiffusionNFT"), ("flow_dppo", "FlowDPPO"),
        ("delightful_pg", "DelightfulPG"), ("customized_grpo", "CustomizedGRPO"),
        ("awm", "AWM"), ("sft", "SFT"), ("online_dpo", "OnlineDPO"),
        ("dgpo", "DGPO"), ("gardo", "GARDO"), ("refl", "ReFL"), ("on_policy_distillation", "OnPolicyDistillation"),
        ("euphonium", "Euphonium"), ("ac_flow", "ACFlow"),
    ]
}
# model families (model.family): a ModelAdapter class with from_config(model_cfg, device)
MODEL_FAMILIES: dict[str, Any] = {
    "sd3": "flowrl.models.sd3:SD3Adapter", "flux": "flowrl.models.flux:FluxAdapter",
    "flux2": "flowrl.models.flux2:Flux2Adapter", "qwenimage": "flowrl.models.qwenimage:QwenImageAdapter",
    "wan": "flowrl.models.wan:WanAdapter",
}
# built-in prompt sets: a function returning the list of prompts
PROMPT_SETS: dict[str, Any] = {
    "shapes-train": "flowrl.shapes.domain:train_prompts",
    "shapes-heldout": "flowrl.shapes.domain:heldout_prompts",
    "moving-shapes-train": "flowrl.shapes.moving:train_prompts",
    "moving-shapes-heldout": "flowrl.shapes.moving:heldout_prompts",
}
# held-out evaluators (log.eval): a class built with no arguments, called as evaluator(sample_fn, seeds)
EVALUATORS: dict[str, Any] = {"shapes": "flowrl.shapes.evaluate:ShapesEvaluator",
                              "moving-shapes": "flowrl.shapes.evaluate:MovingShapesEvaluator"}
# command-line subcommands that plug-ins add: a function(subparsers) that adds them
COMMANDS: dict[str, Any] = {"shapes-demo": "flowrl.shapes.commands:add_commands"}
# pretrained model names that are not hub ids: a function(model_cfg) -> diffusers pipeline
MODEL_NAMES: dict[str, Any] = {"tiny-shapes": "flowrl.shapes.image_model:load_tiny_shapes_pipeline",
                               "tiny-moving-shapes": "flowrl.shapes.video_model:load_tiny_moving_shapes_pipeline",
                               # published architectures with random weights (time and memory at real size)
                               "random-sd3.5-medium": "flowrl.models.published:random_sd35_medium",
                               "random-sd3.5-medium-shrunk": "flowrl.models.published:random_sd35_medium_shrunk"}


def import_plugin(module: str):
    """``importlib.import_module``, with the current folder searched last, as ``python -m`` searches it: a
    ``my_rewards.py`` beside the shell resolves as ``my_rewards`` from the ``flowrl`` command too."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        here = os.getcwd()
        if exc.name != module.split(".")[0] or here in sys.path or "" in sys.path:
            raise
        sys.path.append(here)
        return importlib.import_module(module)


def _import(path: str, what: str):
    module, _, attr = path.partition(":")
    try:
        obj = import_plugin(module)
    except ImportError as exc:
        raise ConfigError(f"{what}: cannot import module {module!r} ({exc})") from exc
    if attr and not hasattr(obj, attr):
        raise ConfigError(f"{what}: module {module!r} has no attribute {attr!r}")
    return getattr(obj, attr) if attr else obj


def resolve(table: dict[str, Any], name: str, what: str):
    """The object registered under ``name`` (imported on first use), or ``module:attribute`` for a plug-in."""
    entry = table.get(name)
    if entry is None and ":" in name:
        entry = name
    if entry is None:
        close = difflib.get_close_matches(name, list(table), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{what}: unknown name {name!r}{hint} (known: {', '.join(sorted(table))}; or give "
                          "module:attribute)")
    if isinstance(entry, str):
        entry = _import(entry, what)
        if name in table:
            table[name] = entry
    return entry


def register(table: dict[str, Any], name: str, obj) -> None:
    table[name] = obj


def algorithm_class(name: str):
    return resolve(ALGORITHMS, name, "algorithm.name")


def register_algorithm(name: str, cls) -> None:
    """Make ``cls`` (a subclass of :class:`flowrl.algorithms.FlowGRPO` with its own ``Options``) available
    as ``algorithm.name: <name>``."""
    register(ALGORITHMS, name, cls)


def adapter_class(name: str):
    """The model adapter class of ``model.family`` (a registered family or ``module:Class``)."""
    return resolve(MODEL_FAMILIES, name, "model.family")


def register_model_family(name: str, cls) -> None:
    """Make ``cls`` (a :class:`flowrl.models.base.ModelAdapter` with ``from_config``) available as
    ``model.family: <name>``."""
    register(MODEL_FAMILIES, name, cls)
