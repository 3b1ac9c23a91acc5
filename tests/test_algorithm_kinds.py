"""The algorithm hierarchy: an abstract Algorithm, its two kinds as siblings, every method on its kind (or a documented
variant of one other method), universal checks no override can skip, and the class diagram in the docs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flowrl.algorithms import Algorithm, ForwardProcessAlgorithm, TransitionAlgorithm
from flowrl.algorithms.base import declares
from flowrl.config import load_config
from flowrl.errors import ConfigError
from flowrl.registry import ALGORITHMS

ROOT = Path(__file__).resolve().parents[1]


def registered() -> dict[type, str]:
    return {ALGORITHMS.resolve(name): name for name in ALGORITHMS.names()}


def class_tree() -> str:
    """The hierarchy from Algorithm down, one class per line, as docs/architecture.md shows it."""
    classes = registered()
    nodes = set(classes)
    for cls in classes:
        nodes.update(c for c in cls.__mro__ if issubclass(c, Algorithm) and c.__module__.startswith("flowrl"))
    lines = []

    def walk(cls: type, prefix: str, last: bool, top: bool) -> None:
        label = cls.__name__ + (f" ({classes[cls]})" if cls in classes else "")
        if cls.variant_of is not None and cls in classes and "variant_of" in vars(cls):
            label += f", a variant of {cls.variant_of.__name__}"
        lines.append(label if top else prefix + ("└── " if last else "├── ") + label)
        kids = sorted((c for c in nodes if c.__bases__[0] is cls), key=lambda c: (c not in classes, c.__name__))
        kids = sorted(kids, key=lambda c: c in classes)  # the kinds (abstract) first, then the methods
        for i, k in enumerate(kids):
            walk(k, "" if top else prefix + ("    " if last else "│   "), i == len(kids) - 1, False)

    walk(Algorithm, "", True, True)
    return "\n".join(lines)


def test_the_class_diagram_in_the_docs_is_the_code_s():
    text = (ROOT / "docs/architecture.md").read_text()
    block = re.search(r"<!-- class diagram -->\n```text\n(.*?)\n```", text, re.S)
    assert block, "docs/architecture.md has no class diagram block"
    assert block.group(1) == class_tree()


def test_no_algorithm_subclasses_another_except_as_a_documented_variant():
    classes = registered()
    variants = 0
    for cls, name in classes.items():
        concrete_parents = [c for c in cls.__mro__[1:] if c in classes]
        if not concrete_parents:
            assert "variant_of" not in vars(cls) or cls.variant_of is None, name
            continue
        variants += 1
        assert vars(cls).get("variant_of") is cls.__bases__[0] is concrete_parents[0], (
            f"{name} subclasses {concrete_parents[0].__name__} without declaring variant_of")
        assert cls.__doc__ and "variant" in cls.__doc__, f"{name}: a variant says so in its docstring"
    assert variants == 7  # Flow-GRPO-Fast, MixGRPO, Customized-GRPO, Euphonium, SFT, DiverseGRPO, Sol-RL
    kinds = {c: [n for c2, n in classes.items() if issubclass(c2, c)] for c in (TransitionAlgorithm,
                                                                                 ForwardProcessAlgorithm)}
    assert set(kinds[ForwardProcessAlgorithm]) == {"diffusion_nft", "sol_rl", "awm", "dgpo", "sft", "online_dpo",
                                                   "ac_flow"}
    assert not set(kinds[TransitionAlgorithm]) & set(kinds[ForwardProcessAlgorithm])
    assert len(kinds[TransitionAlgorithm]) + len(kinds[ForwardProcessAlgorithm]) + 1 == len(classes)  # + refl


def test_every_algorithm_s_config_load_runs_the_universal_checks(monkeypatch):
    """validate() is never overridden, and it calls universal_checks first: with that replaced by a sentinel every
    registered algorithm's config load raises the sentinel, whatever its own check() does."""
    class Sentinel(Exception):
        pass

    def sentinel(cls, cfg):
        raise Sentinel(cls.__name__)

    monkeypatch.setattr(Algorithm, "universal_checks", classmethod(sentinel))
    for cls, name in registered().items():
        assert "validate" not in vars(cls) and "universal_checks" not in vars(cls), name
        with pytest.raises(Sentinel, match=cls.__name__):
            load_config(None, [f"algorithm.name={name}"])


@pytest.mark.parametrize("name", sorted(n for c, n in registered().items() if declares(c.Options, "window")))
def test_a_window_that_does_not_fit_is_refused_for_every_windowed_algorithm(name):
    with pytest.raises(ConfigError, match="algorithm.window"):
        load_config(None, [f"algorithm.name={name}", "sampler.num_steps=6", "algorithm.window.size=9",
                                  "algorithm.window.near_end=full"])


def test_a_kind_s_checks_run_whatever_the_method_s_check_does():
    for cls, name in registered().items():
        if issubclass(cls, ForwardProcessAlgorithm):
            with pytest.raises(ConfigError, match=f"train.kl_untrained_beta: {name} trains on the forward process"):
                load_config(None, [f"algorithm.name={name}", "train.kl_untrained_beta=0.1"])


def test_every_option_a_base_reads_is_declared_on_the_options_of_whoever_inherits_the_read():
    for cls, name in registered().items():
        if issubclass(cls, TransitionAlgorithm) and cls.plan is TransitionAlgorithm.plan:
            assert declares(cls.Options, "window"), name
            if cls.trained_steps is TransitionAlgorithm.trained_steps and not cls.window_required:
                assert declares(cls.Options, "timestep_fraction"), name
            if cls.group is TransitionAlgorithm.group:
                assert declares(cls.Options, "group_size") and declares(cls.Options, "shared_noise"), name
        if issubclass(cls, ForwardProcessAlgorithm):
            if cls.plan is ForwardProcessAlgorithm.plan:
                assert declares(cls.Options, "group_size"), name
            if cls.training_timesteps is ForwardProcessAlgorithm.training_timesteps:
                assert declares(cls.Options, "time_type") and declares(cls.Options, "timesteps_per_sample"), name
    # and no algorithm module reads an option it may lack through getattr
    for path in (ROOT / "flowrl/algorithms").glob("*.py"):
        assert not re.search(r"getattr\((self\.)?(opts|a|o|cfg\.algorithm),", path.read_text()), path.name


def test_every_abstract_hook_is_defined_by_every_registered_algorithm():
    for cls, name in registered().items():
        for hook in ("plan", "make_objective"):
            assert getattr(cls, hook) is not getattr(Algorithm, hook), f"{name} lacks {hook}"
        if issubclass(cls, ForwardProcessAlgorithm) and cls.make_objective is ForwardProcessAlgorithm.make_objective:
            assert cls.forward_process_loss is not ForwardProcessAlgorithm.forward_process_loss, name


def test_every_algorithm_page_links_its_paper_and_code_and_lists_where_ours_differs():
    pages = ROOT / "docs/algorithms"
    for name in registered().values():
        page = pages / f"{name.replace('_', '-')}.md"
        if not page.exists():  # a variant documented on its parent's page (Flow-GRPO-Fast on Flow-GRPO's)
            page = pages / f"{name.replace('_', '-').removesuffix('-fast')}.md"
        text = page.read_text()
        section = text.split("## Paper and code", 1)[-1].split("\n## ", 1)[0]
        assert "## Paper and code" in text and "Paper:" in section and "Reference code:" in section, name
        assert "Where ours differs:" in section and "\n- " in section, name


@pytest.mark.parametrize("overrides", [[], ["algorithm.name=dgpo", "algorithm.group_size=4"]],
                         ids=["flow_grpo", "dgpo (old copy kept)"])
def test_the_trainer_calls_the_hooks_in_the_documented_order(tmp_path, overrides):
    """One iteration's hook calls, recorded on the algorithm: exactly HOOK_ORDER (old_decay only with an old copy)."""
    from tests.conftest import make_cfg
    from flowrl.algorithms.base import HOOK_ORDER
    from flowrl.trainer import Trainer

    trainer = Trainer(make_cfg(tmp_path, "train.iterations=1", "log.eval_every=0", "guard.enabled=false",
                               *overrides))
    algo, calls = trainer.algorithm, []
    for name in HOOK_ORDER:
        hook = getattr(algo, name)

        def recorded(*args, _name=name, _hook=hook, **kwargs):
            calls.append(_name)
            return _hook(*args, **kwargs)

        setattr(algo, name, recorded)
    trainer.iteration(0)
    expected = [h for h in HOOK_ORDER if h != "old_decay" or trainer.policy.old is not None]
    assert calls == expected
    assert ("old_decay" in calls) == (overrides != [])
