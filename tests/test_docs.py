"""The documentation: the site builds strict, the generated references cover the schema and the parser, the shipped
text names only what exists and stays inside the repository, and the extending page's examples run."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import make_cfg

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------- the site
@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=300)
    return proc, out


def test_the_site_builds_strict_without_warnings(site):
    proc, out = site
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert "WARNING" not in log and "ERROR" not in log, log[-3000:]
    for page in ("index.html", "algorithms/branch-grpo/index.html", "reference/config/index.html",
                 "reference/api/index.html", "search/search_index.json"):
        assert (out / page).is_file(), page
    assert not (out / "hooks.py").exists()
    api = (out / "reference/api/index.html").read_text()
    assert "begin_minibatch" in api and not re.search(r":(meth|class|func|attr|data|mod):<code>", api)


def _schema_leaves(schema: dict) -> int:
    """Leaf keys of the JSON Schema, counted without the reference generator: sections are followed through
    their $ref, list entries through ``items``, and the algorithm's alternatives each count their own keys."""
    defs = schema["$defs"]

    def resolve(node):
        while "$ref" in node:
            node = defs[node["$ref"].split("/")[-1]]
        return node

    def count(node) -> int:
        node = resolve(node)
        if "oneOf" in node:
            return sum(count(alt) for alt in node["oneOf"])
        if node.get("type") == "array" and "$ref" in node.get("items", {}):
            return count(node["items"])
        if "properties" in node:
            return sum(count(v) for v in node["properties"].values())
        if "anyOf" in node:  # an optional section (a section or null) or an optional value
            sections = [a for a in node["anyOf"] if "properties" in resolve(a)]
            return count(sections[0]) if sections else 1
        return 1

    return count(schema)


def test_the_configuration_reference_has_one_row_per_schema_key(site):
    from flowrl.config import json_schema, reference_fields

    _, out = site
    html = (out / "reference/config/index.html").read_text()
    rows = re.findall(r"<tr>\s*<td><code>([^<]+)</code></td>", html)
    assert len(rows) == len(reference_fields()) == _schema_leaves(json_schema())
    assert {"train.lr", "train.fsdp.shard_size", "rewards[].name", "algorithm.split_steps",
            "algorithm.window.size"} <= set(rows)
    headings = re.findall(r"<h3 id=\"[^\"]*\">(.*?)<a", html)  # one table per section: no heading twice
    assert len(headings) == len(set(headings)) > 30


def test_the_cli_reference_has_one_section_per_subcommand(site):
    import argparse

    from flowrl.cli import build_parser

    _, out = site
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    html = (out / "reference/cli/index.html").read_text()
    sections = re.findall(r"<h3 id=\"[^\"]*\"><code>flowrl ([a-z0-9-]+)</code>", html)
    assert sorted(sections) == sorted(sub.choices) and len(sections) == len(sub.choices) >= 16


def test_train_help_points_to_config_explain(capsys):
    from flowrl.cli import main

    assert main(["train", "--help"]) == 0
    assert "flowrl config explain" in " ".join(capsys.readouterr().out.split())


# ------------------------------------------------------------------------------------ shipped text
def _shipped_text() -> dict[Path, str]:
    """README, changelog, docs pages, presets, and the text (docstrings and comments) of the package's code."""
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "mkdocs.yml", *sorted((ROOT / "docs").rglob("*.md")),
             *sorted((ROOT / "configs").rglob("*.yaml")), *sorted((ROOT / "assets").rglob("*.md"))]
    for folder in ("flowrl", "rewards", "samplers", "docs"):
        files += sorted((ROOT / folder).rglob("*.py"))
    return {f: f.read_text() for f in files}


OUTSIDE = re.compile(r"\.\./shared|\bspec/|\bdesign\.md|tiny-default\.md|anchors\.md|algorithms-more\.md|peers\.md")
PROCESS = re.compile(r"\b(work )?sessions?\b|\bthis stop\b|\bprevious stop\b|\bstops? \d+\b|\bissues?\b|\blent\b|"
                     r"\bno GPU was\b", re.IGNORECASE)
REPO_PATH = re.compile(r"(?<![\w./-])((?:flowrl|rewards|samplers|configs|tests|assets|docs)/[\w./-]*\w)")
MODULE = re.compile(r"(?<![\w./-])(flowrl(?:\.\w+)+)")


def _exists(path: str, beside: Path) -> bool:
    if any(c in path for c in "*<{") or path.endswith("_"):
        return True  # a pattern or a placeholder (configs/sd35m_*.yaml, configs/<name>.yaml), not one file
    if (ROOT / path).exists() or (beside / path).exists():  # a docs page's links are relative to the page
        return True
    first, _, rest = path.partition("/")  # installed names: flowrl/assets = assets/, flowrl/configs = configs/
    if first == "flowrl" and rest.split("/")[0] in ("assets", "configs", "rewards", "samplers"):
        return (ROOT / rest).exists()
    return False


def _module_exists(dotted: str) -> bool:
    parts = dotted.rstrip(".").split(".")
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is not None:
            obj = importlib.import_module(name)
            for attr in parts[cut:]:
                if not hasattr(obj, attr):
                    return False
                obj = getattr(obj, attr)
            return True
    return False


def test_shipped_text_names_only_what_exists_and_stays_in_the_repository():
    outside, process, missing_paths, missing_modules = [], [], [], []
    for f, text in _shipped_text().items():
        rel = f.relative_to(ROOT)
        for n, line in enumerate(text.splitlines(), 1):
            where = f"{rel}:{n}"
            if OUTSIDE.search(line):
                outside.append(where)
            if PROCESS.search(line):
                process.append(f"{where}: {line.strip()[:80]}")
            for path in REPO_PATH.findall(line):
                if not _exists(path.rstrip("."), f.parent):
                    missing_paths.append(f"{where}: {path}")
            for dotted in MODULE.findall(line):
                if dotted.rsplit(".", 1)[-1] in ("json", "yaml", "py", "md"):
                    continue  # a file name (flowrl.schema.json), not a module
                if not _module_exists(dotted):
                    missing_modules.append(f"{where}: {dotted}")
    assert not outside, outside
    assert not process, process
    assert not missing_paths, missing_paths
    assert not missing_modules, missing_modules


def test_readme_is_short_and_starts_with_the_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < 200
    assert lines[3].startswith("make demo") and lines[4].startswith("make test")
    for target in re.findall(r"\]\(([^)#]+)", "\n".join(lines)):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), target


# ------------------------------------------------------------------------ the extending page's examples
def _example(name: str, tmp_path: Path) -> str:
    """Write the page's ``<!-- example: NAME -->`` code block to the module file its first line names."""
    page = (ROOT / "docs/extending.md").read_text()
    code = re.search(rf"<!-- example: {name} -->\s*```python\n(.*?)```", page, re.S).group(1)
    module = re.match(r"# (\w+)\.py\n", code).group(1)
    (tmp_path / f"{module}.py").write_text(code)
    sys.path.insert(0, str(tmp_path))
    return module


@pytest.fixture
def examples_path(tmp_path):
    yield tmp_path
    sys.path.remove(str(tmp_path)) if str(tmp_path) in sys.path else None
    for name in ("my_algorithms", "my_rewards", "my_models", "my_callbacks"):
        sys.modules.pop(name, None)


def test_the_algorithm_example_trains_with_ratio_one(examples_path):
    from flowrl.algorithms import make_algorithm
    from flowrl.errors import ConfigError
    from flowrl.trainer import Trainer

    module = _example("algorithm", examples_path)
    cfg = make_cfg(examples_path / "runs", f"algorithm.name={module}:FirstStepsGRPO", "algorithm.first_steps=2",
                   "sampler.num_steps=4", "train.prompts_per_iter=2")
    assert [s.trained for s in make_algorithm(cfg).plan(0).steps] == [True, True, False, False]
    row = Trainer(cfg).iteration(0)
    assert row["trained_edges"] > 0 and row["ratio_max_abs_dev_first_update"] < 1e-5
    with pytest.raises(ConfigError, match=r"algorithm.first_steps: 9 is more than sampler.num_steps \(4\)"):
        make_cfg(examples_path / "runs", "algorithm.name=first_steps_grpo", "algorithm.first_steps=9",
                 "sampler.num_steps=4")


def test_the_reward_example_scores_by_hand_and_trains(examples_path):
    import torch

    from flowrl.trainer import Trainer

    module = _example("reward", examples_path)
    redness = importlib.import_module(module).redness
    images = torch.zeros(3, 3, 4, 4)
    images[0, 0] = 1.0  # pure red: 1 - (0 + 0) / 2
    images[1] = 0.5  # grey: 0
    images[2, 1] = 1.0  # pure green: 0 - (1 + 0) / 2
    assert redness(images, ["a"] * 3, [{}] * 3).tolist() == [1.0, 0.0, -0.5]
    cfg = make_cfg(examples_path / "runs", f"rewards[0].name={module}:redness", "sampler.num_steps=4",
                   "train.prompts_per_iter=2")
    row = Trainer(cfg).iteration(0)
    assert -1.0 <= row["reward_mean/total"] <= 1.0 and row["ratio_max_abs_dev_first_update"] < 1e-5


def test_the_model_family_example_samples_on_its_own_grid(examples_path):
    import torch

    from flowrl.models import load_adapter
    from flowrl.sampling import sigmas_for
    from flowrl.trainer import Trainer

    module = _example("model-family", examples_path)
    cfg = make_cfg(examples_path / "runs", f"model.family={module}:LinearSD3Adapter", "sampler.num_steps=4",
                   "train.prompts_per_iter=2")
    adapter = load_adapter(cfg.model)
    assert adapter.family == "linear_sd3"
    assert torch.equal(sigmas_for(cfg, adapter, 4), torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))
    row = Trainer(cfg).iteration(0)
    assert row["trained_edges"] > 0 and row["ratio_max_abs_dev_first_update"] < 1e-5


@pytest.mark.heavy
def test_the_plug_in_commands_run_as_printed_from_the_module_s_folder(tmp_path):
    """extending.md's `flowrl train ... my_module:attr` commands, run from the folder that holds the module (the
    page's code written there), with nothing on PYTHONPATH: the current folder is searched, as `python -m` does.
    Shortened with overrides appended (one iteration), the printed part unchanged."""
    import shlex
    import subprocess

    page = (ROOT / "docs/extending.md").read_text()
    commands = []
    for name in ("algorithm", "reward"):
        block = re.search(rf"<!-- example: {name} -->\s*```python\n(.*?)```\s*```bash\n(.*?)```", page, re.S)
        module = re.match(r"# (\w+)\.py\n", block.group(1)).group(1)
        (tmp_path / f"{module}.py").write_text(block.group(1))
        commands.append(block.group(2).strip())
    script = Path(sys.executable).parent / "flowrl"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for command in commands:
        argv = shlex.split(command)
        assert argv[0] == "flowrl"
        done = subprocess.run([str(script), *argv[1:], "train.iterations=1", "train.prompts_per_iter=2",
                               "sampler.num_steps=4", "log.sample_every=0", "log.progress=false",
                               "log.output_dir=runs"], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, (command, done.stderr[-2000:])
    assert len(list((tmp_path / "runs").iterdir())) == 2


def test_the_callback_example_stops_a_run(examples_path):
    """extending.md's callback, given to the trainer: with patience 1 the run stops after the first iteration
    without a new best, and the metrics end there."""
    import json

    from flowrl.trainer import Trainer

    module = _example("callback", examples_path)
    stop_when_flat = importlib.import_module(module).StopWhenFlat
    cfg = make_cfg(examples_path / "runs", "train.iterations=12", "sampler.num_steps=4", "train.prompts_per_iter=2")
    callback = stop_when_flat(patience=1)
    run = Trainer(cfg, callbacks=[callback]).train()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward_mean/total"] for r in rows]
    assert callback.since == 1 and rewards[-1] <= max(rewards[:-1])  # stopped at the first iteration without a best
    assert all(rewards[k] > max(rewards[:k], default=float("-inf")) for k in range(len(rewards) - 1))
