"""One registry mechanism for every kind of plug-in: built-in names are lazy ``module:attribute`` strings that all
import, users register in-process (call or decorator) or name ``module:attribute``, installed packages add names
through entry points, and a bad name is one line naming the closest."""

from __future__ import annotations

import importlib.metadata
import inspect

import pytest
import torch

from flowrl.errors import ConfigError, RewardError
from flowrl.registry import (ALGORITHMS, COMMANDS, EVALUATORS, MODEL_FAMILIES, MODEL_NAMES, PROMPT_SETS,
                             Registry)
from flowrl.rewards import REWARDS, build_reward, register_reward

ALL = {"algorithms": ALGORITHMS, "families": MODEL_FAMILIES, "rewards": REWARDS, "prompt sets": PROMPT_SETS,
       "evaluators": EVALUATORS, "commands": COMMANDS, "model names": MODEL_NAMES}


@pytest.mark.parametrize("kind", list(ALL))
def test_every_built_in_name_imports_to_a_class_or_function(kind):
    registry = ALL[kind]
    assert isinstance(registry, Registry)
    for name in list(registry):
        obj = registry.resolve(name)
        assert inspect.isclass(obj) or inspect.isfunction(obj), (kind, name, obj)
        assert registry[name] is obj  # imported once, then kept


def test_a_reward_registers_by_call_or_decorator_and_builds():
    @register_reward("test_brightness")
    def brightness(gain: float = 1.0):  # a factory: its arguments are the config's rewards[i].args
        return lambda images, prompts, metadata: gain * images.mean(dim=(1, 2, 3))

    assert REWARDS["test_brightness"] is brightness and "test_brightness" in REWARDS.names()
    images = torch.tensor([0.25, 0.75]).view(2, 1, 1, 1).expand(2, 3, 4, 4)
    assert build_reward("test_brightness", gain=2.0)(images, ["a", "b"], [{}, {}]).tolist() == [0.5, 1.5]
    REWARDS.pop("test_brightness")


def test_an_installed_entry_point_is_found_by_name(monkeypatch):
    """A package that declares ``[project.entry-points.flowrl_rewards] ep_jpeg = "..."`` adds ``ep_jpeg``: listed,
    resolved without ``module:`` in the config, kept after the first import; other groups do not see it."""
    point = importlib.metadata.EntryPoint("ep_jpeg", "flowrl.rewards.jpeg:JpegCompressibility", "flowrl_rewards")

    def entry_points(group=None):
        return [point] if group == "flowrl_rewards" else []

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    assert "ep_jpeg" in REWARDS.names() and "ep_jpeg" not in ALGORITHMS.names()
    from flowrl.rewards.jpeg import JpegCompressibility

    scorer = build_reward("ep_jpeg")
    assert isinstance(scorer, JpegCompressibility)
    flat = torch.full((1, 3, 32, 32), 0.5)
    noisy = torch.rand((1, 3, 32, 32), generator=torch.Generator().manual_seed(0))
    assert scorer(flat, ["x"], [{}]).item() > scorer(noisy, ["x"], [{}]).item()  # flat compresses better
    REWARDS.pop("ep_jpeg")


def test_a_bad_name_is_one_line_with_the_closest_and_the_registry_s_error():
    with pytest.raises(ConfigError, match=r"algorithm.name: unknown name 'flow_grp'; did you mean 'flow_grpo'\?"):
        ALGORITHMS.resolve("flow_grp")
    with pytest.raises(RewardError, match=r"reward: unknown name 'pickscor'; did you mean 'pickscore'\?"):
        build_reward("pickscor")
    with pytest.raises(ConfigError, match=r"model.family: module 'flowrl.models.sd3' has no attribute 'Nope'"):
        MODEL_FAMILIES.resolve("flowrl.models.sd3:Nope")
    assert "flowrl.models.sd3:Nope" not in MODEL_FAMILIES
