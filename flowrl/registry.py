"""Names -> implementations, one mechanism for every kind of plug-in: algorithms, model families, rewards,
prompt sets, evaluators, embedded model names and command groups.

The core never imports an algorithm module, a family, the shapes demo or a user's plug-in by module name: it asks
a :class:`Registry`, whose built-in entries are ``"module:attribute"`` strings imported on first use. A user adds
their own in three ways: ``REGISTRY.register(name, obj)`` (or as a decorator) in-process; ``module:attribute`` as
the name in a config (the current folder is searched, as ``python -m`` searches it); or, for an installed
package, an entry point in the registry's group (``[project.entry-points.flowrl_algorithms]`` in its
pyproject.toml: ``my_method = "my_package.methods:MyMethod"``), found by name without an import in the config.
"""

from __future__ import annotations

import contextvars
import difflib
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError


class Registry(dict):
    """One kind of plug-in by name: values are the objects, or ``"module:attribute"`` strings until first use.

    Args:
        what: the config key the names come from, for messages (``"algorithm.name"``).
        entries: the built-in names.
        group: the entry-point group installed packages add names to (``"flowrl_algorithms"``).
        error: the exception class of a bad name (:class:`~flowrl.errors.ConfigError` unless given).
    """

    def __init__(self, what: str, entries: dict[str, Any] | None = None, group: str | None = None,
                 error: type[Exception] = ConfigError, kind: tuple[Callable[[Any], bool], str] | None = None):
        super().__init__(entries or {})
        self.what, self.group, self.error = what, group, error
        self.kind = kind  # (test, what the object must be): a plug-in that fails the test is refused in one line

    def register(self, name: str, obj: Any = None):
        """``registry.register("name", obj)``, or ``@registry.register("name")`` on a class or function."""
        if obj is None:
            return lambda target: self.register(name, target) or target
        self[name] = obj
        return obj

    def _entry_points(self) -> dict[str, Any]:
        if self.group is None:
            return {}
        from importlib.metadata import entry_points

        return {ep.name: ep for ep in entry_points(group=self.group)}

    def names(self) -> list[str]:
        """Every name this registry answers to: built-in, registered and installed (entry points), sorted."""
        return sorted(set(self) | set(self._entry_points()))

    def resolve(self, name: str):
        """The object registered under ``name`` (imported on first use), an installed entry point's, or
        ``module:attribute`` for a plug-in; one line naming the closest known name otherwise."""
        entry = self.get(name)
        if entry is None and ":" in name:
            entry = name
        if entry is None:
            found = self._entry_points().get(name)
            if found is not None:
                entry = f"{found.module}:{found.attr}" if found.attr else found.module
        if entry is None:
            close = difflib.get_close_matches(name, self.names(), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise self.error(f"{self.what}: unknown name {name!r}{hint} (known: {', '.join(self.names())}; or give "
                             "module:attribute)")
        if isinstance(entry, str):
            if entry == name and ":" in name:  # a plug-in named by the config itself, not a built-in entry
                search_here = _check_untrusted(self.what, name)
                entry = self._import(entry, search_here)
            else:
                entry = self._import(entry)
            if self.kind is not None and not self.kind[0](entry):
                shown = type(entry).__name__ if not callable(entry) else getattr(entry, "__name__", "an object")
                raise self.error(f"{self.what}: {name!r} is {shown}, not {self.kind[1]}")
            if ":" not in name:  # a built-in or installed name imports once; module:attribute is not kept
                self[name] = entry
        return entry

    def _import(self, path: str, search_here: bool = True):
        module, _, attr = path.partition(":")
        try:
            obj = import_plugin(module) if search_here else importlib.import_module(module)
        except ImportError as exc:
            raise self.error(f"{self.what}: cannot import module {module!r} ({exc})") from exc
        except Exception as exc:  # the module itself fails as it loads: its error, in one line
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            raise self.error(f"{self.what}: importing module {module!r} failed: {type(exc).__name__}: {first}") from exc
        if attr and not hasattr(obj, attr):
            raise self.error(f"{self.what}: module {module!r} has no attribute {attr!r}")
        return getattr(obj, attr) if attr else obj


ALGORITHMS = Registry("algorithm.name", {
    name: f"flowrl.algorithms.{name}:{cls}" for name, cls in [
        ("flow_grpo", "FlowGRPO"), ("flow_grpo_fast", "FlowGRPOFast"), ("mix_grpo", "MixGRPO"),
        ("dance_grpo", "DanceGRPO"), ("branch_grpo", "BranchGRPO"), ("tempflow_grpo", "TempFlowGRPO"),
        ("e_grpo", "EGRPO"), ("chunk_grpo", "ChunkGRPO"), ("superflow", "SuperFlow"), ("ada_grpo", "AdaGRPO"),
        ("diffusion_nft", "DiffusionNFT"), ("flow_dppo", "FlowDPPO"),
        ("delightful_pg", "DelightfulPG"), ("customized_grpo", "CustomizedGRPO"),
        ("awm", "AWM"), ("sft", "SFT"), ("online_dpo", "OnlineDPO"),
        ("dgpo", "DGPO"), ("gardo", "GARDO"), ("refl", "ReFL"), ("on_policy_distillation", "OnPolicyDistillation"),
        ("euphonium", "Euphonium"), ("ac_flow", "ACFlow"), ("tree_grpo", "TreeGRPO"),
        ("diverse_grpo", "DiverseGRPO"), ("flash_grpo", "FlashGRPO"), ("sol_rl", "SolRL"),
    ]
}, group="flowrl_algorithms", kind=(lambda o: inspect.isclass(o) and hasattr(o, "Options") and hasattr(o, "plan"),
                                   "an algorithm class (a subclass of flowrl.algorithms.Algorithm)"))
# model families (model.family): a ModelAdapter class with from_config(model_cfg, device)
DEFAULT_FAMILY = "sd3"
MODEL_FAMILIES = Registry("model.family", {
    "sd3": "flowrl.models.sd3:SD3Adapter", "flux": "flowrl.models.flux:FluxAdapter", "flux-kontext": "flowrl.models.flux_kontext:FluxKontextAdapter",
    "flux2": "flowrl.models.flux2:Flux2Adapter", "qwenimage": "flowrl.models.qwenimage:QwenImageAdapter",
    "qwenimage-edit": "flowrl.models.qwenimage_edit:QwenImageEditAdapter",
    "qwenimage-edit-plus": "flowrl.models.qwenimage_edit:QwenImageEditPlusAdapter",
    "wan": "flowrl.models.wan:WanAdapter", "hunyuanvideo15": "flowrl.models.hunyuanvideo15:HunyuanVideo15Adapter", "ltx2": "flowrl.models.ltx2:LTX2Adapter", "zimage": "flowrl.models.zimage:ZImageAdapter",
}, group="flowrl_model_families", kind=(lambda o: inspect.isclass(o) and hasattr(o, "from_config"),
                                       "a model adapter class (with from_config)"))
# built-in prompt sets: a function returning the list of prompts
PROMPT_SETS = Registry("data.prompt_set", {
    "shapes-train": "flowrl.shapes.domain:train_prompts",
    "shapes-heldout": "flowrl.shapes.domain:heldout_prompts",
    "moving-shapes-train": "flowrl.shapes.moving:train_prompts",
    "moving-shapes-heldout": "flowrl.shapes.moving:heldout_prompts",
    "shapes-edit-train": "flowrl.shapes.editing:train_edit_prompts",
    "shapes-edit-heldout": "flowrl.shapes.editing:heldout_edit_prompts",
}, group="flowrl_prompt_sets", kind=(callable, "a function returning prompts"))
# source images drawn by a renderer (an edit request's source key "scheme:spec"): a function(spec, size) -> RGB PIL
SOURCE_SCHEMES = Registry("source image scheme", {"shapes": "flowrl.shapes.editing:render_source"},
                          group="flowrl_source_schemes")
# held-out evaluators (log.eval): a class built with no arguments, called as evaluator(sample_fn, seeds)
EVALUATORS = Registry("log.eval", {"shapes": "flowrl.shapes.evaluate:ShapesEvaluator",
                                   "moving-shapes": "flowrl.shapes.evaluate:MovingShapesEvaluator",
                                   "shapes-edit": "flowrl.shapes.editing:ShapesEditEvaluator"},
                      group="flowrl_evaluators",
                      kind=(inspect.isclass, "an evaluator class (built with no arguments, then called)"))
# command-line subcommands that plug-ins add: a function(subparsers) that adds them
COMMANDS = Registry("command", {"shapes-demo": "flowrl.shapes.commands:add_commands"}, group="flowrl_commands",
                    kind=(callable, "a function that adds subcommands"))
# pretrained model names that are not hub ids: a function(model_cfg) -> diffusers pipeline
MODEL_NAMES = Registry("model.pretrained", {
    "tiny-shapes": "flowrl.shapes.image_model:load_tiny_shapes_pipeline",
    "tiny-moving-shapes": "flowrl.shapes.video_model:load_tiny_moving_shapes_pipeline",
    "tiny-shapes-edit": "flowrl.shapes.image_model:load_tiny_shapes_edit_pipeline",
    # published architectures with random weights (time and memory at real size)
    "random-sd3.5-medium": "flowrl.models.published:random_sd35_medium",
    "random-sd3.5-medium-shrunk": "flowrl.models.published:random_sd35_medium_shrunk"})


def import_plugin(module: str):
    """``importlib.import_module``, with the current folder searched last, as ``python -m`` searches it: a
    ``my_rewards.py`` beside the shell resolves as ``my_rewards`` from the ``flowrl`` command too. The folder is on
    the import path only for this import (``sys.path`` is left as it was)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        here = os.getcwd()
        if exc.name != module.split(".")[0] or here in sys.path or "" in sys.path:
            raise
        sys.path.append(here)
        try:
            return importlib.import_module(module)
        finally:
            if here in sys.path:
                sys.path.remove(here)


@dataclass(frozen=True)
class UntrustedNames:
    """Where the names being resolved come from when that is not the user: a run folder someone may have sent.

    ``module:attribute`` names imported from such a config would run its code, so they are refused unless the
    user typed them (``typed``: the command line's own words) or allowed them explicitly (``allow``; even then
    the current folder is not searched for them)."""

    source: str
    typed: tuple[str, ...] = ()
    allow: bool = False

    def typed_by_user(self, name: str) -> bool:
        return any(name in word for word in self.typed)


_UNTRUSTED: contextvars.ContextVar[UntrustedNames | None] = contextvars.ContextVar("flowrl_untrusted_names",
                                                                                   default=None)


def names_come_from(source: str, typed: Iterable[str] = (), allow: bool = False) -> None:
    """From here on in this context (a CLI call runs in its own), ``module:attribute`` names come from ``source``,
    a saved run's config: they are imported only if they appear in ``typed`` (the command line) or ``allow``."""
    _UNTRUSTED.set(UntrustedNames(str(source), tuple(typed), allow))


def _check_untrusted(what: str, name: str) -> bool:
    """Refuse a plug-in name that a run folder's config gave; True when the current folder may be searched."""
    gate = _UNTRUSTED.get()
    if gate is None or gate.typed_by_user(name):
        return True
    if gate.allow:
        return False  # the user allowed the run's plug-ins: imported from the installed packages and PYTHONPATH only
    raise ConfigError(f"{what}: {name!r} comes from {gate.source}, and flowrl does not run code named by a saved "
                      f"run; name it yourself on the command line or add --allow-plugins if you trust that run")


def algorithm_class(name: str):
    return ALGORITHMS.resolve(name)


def register_algorithm(name: str, cls) -> None:
    """Make ``cls`` (a subclass of :class:`flowrl.algorithms.Algorithm`, usually through one of its kinds, with its own ``Options``) available
    as ``algorithm.name: <name>``."""
    ALGORITHMS.register(name, cls)


def adapter_class(name: str):
    """The model adapter class of ``model.family`` (a registered family or ``module:Class``)."""
    return MODEL_FAMILIES.resolve(name)


def register_model_family(name: str, cls) -> None:
    """Make ``cls`` (a :class:`flowrl.models.base.ModelAdapter` with ``from_config``) available as
    ``model.family: <name>``."""
    MODEL_FAMILIES.register(name, cls)
