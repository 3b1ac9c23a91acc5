"""flowrl rank --plan: a plan's runs are trained (dependencies first, two at a time), kept when finished, ranked
and drawn."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy  # processes launched in subprocesses: `make test-heavy`

PLAN = """
protocol: [train.iterations=1, train.prompts_per_iter=2, sampler.num_steps=4, "log.eval_seeds=[0]", log.eval_every=0,
           log.sample_every=0, log.save_every=0, log.eval=shapes, model.pretrained=tiny-shapes, model.resolution=32,
           data.prompt_set=shapes-train, "rewards=[{name: shapes}]"]
seeds: [0, 1]
baseline: grpo
jobs: 2
labels:
  student:  # waits for the teacher run
    config: configs/tiny_flow_grpo.yaml
    overrides: [algorithm.name=on_policy_distillation, "algorithm.teacher={run:grpo:0}", train.kl_beta=1.0, algorithm.group_size=2,
                train.lora.enabled=false]
  grpo:
    config: configs/tiny_flow_grpo.yaml
    overrides: [algorithm.group_size=2, train.lora.enabled=false]
"""


def test_plan_trains_ranks_and_keeps_finished_runs(tmp_path, monkeypatch, capsys):
    from flowrl.cli import main
    from flowrl.report.plan import read_plan

    import shutil
    from pathlib import Path

    monkeypatch.chdir(tmp_path)

    root = Path(__file__).resolve().parent.parent
    shutil.copytree(root / "configs", tmp_path / "configs", dirs_exist_ok=True)
    (tmp_path / "plan.yaml").write_text(PLAN)
    _, runs = read_plan(tmp_path / "plan.yaml")
    # the plan's order, each run after the run it names
    assert [r.name for r in runs] == ["grpo-s0", "student-s0", "student-s1", "grpo-s1"]
    assert main(["rank", "--plan", "plan.yaml", "--out", "ranked"]) == 0
    out = capsys.readouterr().out
    assert "| grpo |" in out and "| student |" in out and "baseline" in out
    for name in ("grpo-s0", "grpo-s1", "student-s0", "student-s1"):
        assert "after" in json.loads((tmp_path / "ranked" / name / "eval.json").read_text())
    cmd = (tmp_path / "ranked" / "logs" / "student-s1.log").read_text().splitlines()[0]
    assert "algorithm.teacher=ranked/grpo-s0 " in cmd  # the run it named, by its folder
    assert (tmp_path / "ranked" / "rank.md").is_file() and (tmp_path / "ranked" / "compare.png").is_file()
    assert (tmp_path / "ranked" / "rank.png").stat().st_size > 1000
    stamp = (tmp_path / "ranked" / "grpo-s0" / "eval.json").stat().st_mtime
    assert main(["rank", "--plan", "plan.yaml", "--out", "ranked"]) == 0  # nothing left to train
    assert (tmp_path / "ranked" / "grpo-s0" / "eval.json").stat().st_mtime == stamp


def test_plan_errors_are_one_line(tmp_path):
    from flowrl.errors import ConfigError
    from flowrl.report.plan import read_plan

    (tmp_path / "p.yaml").write_text("protocol: []\nseeds: [0]\nlabels:\n  a: {config: configs/none.yaml}\n")
    with pytest.raises(ConfigError, match="label 'a': no config configs/none.yaml"):
        read_plan(tmp_path / "p.yaml")
    (tmp_path / "q.yaml").write_text(f"protocol: []\nseeds: [0]\nlabels:\n  a: {{config: {tmp_path / 'p.yaml'}, "
                                     "overrides: ['x={run:b:0}']}\n")
    with pytest.raises(ConfigError, match="a-s0 names b-s0, which the plan does not run"):
        read_plan(tmp_path / "q.yaml")


def test_the_shipped_ranked_plan_is_found_from_any_folder(tmp_path, monkeypatch):
    """`flowrl rank --plan configs/benchmarks/ranked.yaml`, the command on the benchmarks page, works outside the
    repository: the plan and every label's preset resolve to the shipped files."""
    from flowrl.report.plan import read_plan
    from flowrl.resources import configs_dir

    monkeypatch.chdir(tmp_path)
    plan, runs = read_plan("configs/benchmarks/ranked.yaml")
    assert plan["baseline"] == "flat" and len(plan["labels"]) == 29
    assert {r.label for r in runs} == set(plan["labels"]) and len(runs) == 101
    assert all(Path(r.config).is_file() and Path(r.config).parent == configs_dir() for r in runs)

