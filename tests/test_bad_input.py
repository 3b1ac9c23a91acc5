"""Bad input ends in one line saying what to change, before any work where it can be known then: seeds beyond
their range, a run with nothing to learn from, a damaged micro_batch.json, a LoRA teacher for a full student."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flowrl.config import load_config
from flowrl.errors import ConfigError, FlowRLError

ROOT = Path(__file__).resolve().parent.parent
FAST = ["train.prompts_per_iter=2", "log.sample_every=0", "log.progress=false", "log.eval=none"]


def _one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    return text


# ------------------------------------------------------------------------------------------ A: seeds
@pytest.mark.parametrize("override, key", [("train.seed=99999999999999999999", "train.seed"),
                                           ("train.seed=-1", "train.seed"),
                                           ("data.sample_seeds=[0,99999999999999999999]", "data.sample_seeds"),
                                           ("log.eval_seeds=[-3]", "log.eval_seeds"),
                                           ("model.tiny.init_seed=18446744073709551616", "model.tiny.init_seed")])
def test_seeds_outside_their_range_are_one_line(override, key):
    with pytest.raises(ConfigError) as err:
        load_config("configs/tiny_flow_grpo.yaml", [override])
    assert _one_line(err).startswith(key)


def test_a_command_line_seed_beyond_64_bits_is_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "flowrl", "sample", "configs/tiny_flow_grpo.yaml", "--prompt", "a",
                           "--seeds", "0,99999999999999999999", "--out", str(tmp_path / "s.png")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0 and "--seeds" in done.stderr
    assert not (tmp_path / "s.png").exists()


def test_a_plan_seed_outside_train_seed_s_range_is_one_line(tmp_path):
    from flowrl.report.plan import read_plan

    plan = tmp_path / "plan.yaml"
    plan.write_text("protocol: {}\nseeds: [0, 1099511627776]\nlabels:\n  flat: {config: tiny_flow_grpo}\n")
    with pytest.raises(ConfigError) as err:
        read_plan(plan)
    assert "1099511627776" in _one_line(err)


# ------------------------------------------------------------------------------------------ I: no learning signal
def test_only_zero_weights_or_an_unbounded_noise_level_are_refused():
    with pytest.raises(ConfigError) as err:
        load_config("configs/tiny_flow_grpo.yaml", ["rewards[0].weight=0"])
    assert "weight 0" in _one_line(err)
    with pytest.raises(ConfigError) as err:
        load_config("configs/tiny_flow_grpo.yaml", ["sampler.noise_level=1e6"])
    assert _one_line(err).startswith("sampler.noise_level")


def constant_reward(images, prompts, metadata=None):
    return torch.full((len(images),), 0.5)


def test_a_run_whose_groups_never_differ_stops_in_one_line(tmp_path):
    from flowrl.trainer import Trainer

    cfg = load_config("configs/tiny_flow_grpo.yaml", [*FAST, "train.iterations=6", f"log.output_dir={tmp_path}",
                                                      "log.run_name=flat", "log.stop_without_signal=2",
                                                      "rewards[0].name=tests.test_bad_input:constant_reward"])
    with pytest.raises(FlowRLError) as err:
        Trainer(cfg).train()
    assert "no learning signal" in _one_line(err) and "iterations 0..1" in str(err.value)
    rows = [json.loads(line) for line in (tmp_path / "flat/metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1] and all(r["reward_std/total"] == 0.0 for r in rows)


# ------------------------------------------------------------------------------------------ J: micro_batch.json
@pytest.fixture(scope="module")
def auto_run(tmp_path_factory):
    """One finished iteration of a run with train.micro_batch=auto (trained once for the cases below)."""
    from flowrl.trainer import Trainer

    out = tmp_path_factory.mktemp("auto")
    Trainer(load_config("configs/tiny_flow_grpo.yaml", [*FAST, f"log.output_dir={out}", "log.run_name=auto",
                                                        "train.micro_batch=auto", "train.iterations=1"])).train()
    return out / "auto"


@pytest.mark.parametrize("content", ['{"micro_batch": ', '{"micro_batch": "four"}', '{"micro_batch": -5}',
                                     "\x00\x01\x02binary", '{"micro_batch": true}'])
def test_a_damaged_micro_batch_file_is_one_line_before_the_model_loads(tmp_path, content, monkeypatch, auto_run):
    import shutil

    from flowrl import trainer as trainer_module
    from flowrl.trainer import Trainer

    shutil.copytree(auto_run, tmp_path / "auto")
    (tmp_path / "auto/micro_batch.json").write_text(content)
    loads = []
    monkeypatch.setattr(trainer_module, "load_adapter", lambda *a, **k: loads.append(a))
    with pytest.raises(ConfigError) as err:
        Trainer(load_config("configs/tiny_flow_grpo.yaml", [*FAST, f"log.output_dir={tmp_path}", "log.run_name=auto",
                                                            "train.micro_batch=auto", "train.iterations=2",
                                                            "resume=latest"]))
    assert "micro_batch.json" in _one_line(err) and not loads


# ------------------------------------------------------------------------------------------ K: teacher layout
def test_a_lora_teacher_for_a_full_fine_tuning_student_is_one_line_before_the_model_loads(tmp_path, monkeypatch):
    from flowrl import trainer as trainer_module
    from flowrl.trainer import Trainer

    teacher = Trainer(load_config("configs/tiny_flow_grpo.yaml", [*FAST, "train.iterations=1",
                                                                  f"log.output_dir={tmp_path}", "log.run_name=t"])).train()
    loads = []
    monkeypatch.setattr(trainer_module, "load_adapter", lambda *a, **k: loads.append(a))
    cfg = load_config("configs/tiny_flow_grpo.yaml", [*FAST, "algorithm.name=on_policy_distillation",
                                                      f"algorithm.teacher={teacher}", "train.kl_beta=1.0",
                                                      "train.lora.enabled=false", f"log.output_dir={tmp_path}",
                                                      "log.run_name=s"])
    with pytest.raises(ConfigError) as err:
        Trainer(cfg)
    assert "LoRA weights" in _one_line(err) and "train.lora.enabled=false" in str(err.value) and not loads


# ------------------------------------------------------------------------------------------ C: the reward server
@pytest.mark.parametrize("flag, value", [("--port", "99999"), ("--port", "-2"), ("--max-mb", "-1"),
                                         ("--max-mb", "nan")])
def test_serve_reward_refuses_an_impossible_port_or_size_in_one_line(flag, value):
    done = subprocess.run([sys.executable, "-m", "flowrl", "serve-reward", "jpeg_compressibility", flag, value],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0 and flag in done.stderr, done.stderr


@pytest.mark.parametrize("images, prompts, expect", [
    (torch.full((2, 3, 8, 8), 255.0), ["a", "b"], "pixel values span"),
    (torch.rand(2, 3, 8, 8), ["only one"], "2 images and 1 prompts"),
    (torch.rand(2, 8, 8), ["a", "b"], "shape"),
])
def test_the_reward_server_scores_only_what_it_can_score(images, prompts, expect):
    import threading
    import urllib.error
    import urllib.request

    from flowrl.rewards.remote import encode_request, make_server

    calls = []
    server = make_server("unused", port=0, scorer=lambda im, p, m: calls.append(len(p)) or torch.zeros(len(p)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/score"
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(urllib.request.Request(url, data=encode_request(images, prompts, None)), timeout=10)
        assert err.value.code == 400 and expect in json.loads(err.value.read())["error"] and not calls
        good = urllib.request.urlopen(urllib.request.Request(url, data=encode_request(torch.rand(2, 3, 8, 8), ["a", "b"],
                                                                                      None)), timeout=10)
        assert json.loads(good.read())["scores"] == [0.0, 0.0] and calls == [2]
    finally:
        server.shutdown()


# ------------------------------------------------------------------------------------------ F: datasets
@pytest.mark.parametrize("name, content, expect", [
    ("empty.jsonl", "", "is empty"),
    ("empty.csv", "", "is empty"),
    ("bad.jsonl", '{"prompt": "a cat"}\n{"prompt": "a dog"\n{"prompt": "x"}\n', "JSON parse error"),
    ("broken.parquet", None, "Parquet magic bytes"),
])
def test_a_damaged_dataset_is_one_line_naming_its_cause(tmp_path, capfd, name, content, expect):
    from flowrl.prompts import read_dataset

    path = tmp_path / name
    if content is None:  # a parquet file whose footer is cut off
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"prompt": ["a", "b"]}), path)
        path.write_bytes(path.read_bytes()[:-20])
    else:
        path.write_text(content)
    capfd.readouterr()
    with pytest.raises(ConfigError) as err:
        read_dataset(str(path))
    assert expect in _one_line(err) and _one_line(err).startswith("data.dataset")
    assert capfd.readouterr().err == ""  # the datasets library's own log lines and bars are kept quiet


# ------------------------------------------------------------------------------------------ G: evaluation
def _eval(args, capsys):
    from flowrl.cli import main

    code = main(["eval", "configs/tiny_flow_grpo.yaml", "log.progress=false", *args])
    return code, capsys.readouterr().err.strip().splitlines()


def test_eval_refuses_before_sampling_a_missing_group_column_an_existing_output_or_a_folder(tmp_path, capsys,
                                                                                           monkeypatch):
    from flowrl import cli

    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "a red circle", "tag": "colors"}\n{"prompt": "a blue square"}\n')
    loads = []
    monkeypatch.setattr("flowrl.models.load_adapter", lambda *a, **k: loads.append(a))
    common = ["--dataset", str(data), "--reward", "jpeg_incompressibility", "--seeds", "0"]
    code, err = _eval([*common, "--group-by", "tag", "--csv", str(tmp_path / "e.csv")], capsys)
    assert code == 2 and len(err) == 1 and "prompt 1" in err[0] and "the columns: tag" in err[0]
    (tmp_path / "old.csv").write_text("metric,mean\n")
    code, err = _eval([*common, "--csv", str(tmp_path / "old.csv")], capsys)
    assert code == 2 and len(err) == 1 and "exists; choose a new name" in err[0]
    assert (tmp_path / "old.csv").read_text() == "metric,mean\n"
    code, err = _eval([*common, "--csv", str(tmp_path)], capsys)
    assert code == 2 and len(err) == 1 and "is a folder" in err[0]
    assert not loads and cli  # nothing was sampled


def test_eval_writes_strict_json_where_a_metric_is_nan(tmp_path, capsys):
    from flowrl.cli import finite_json

    assert finite_json({"a": float("nan"), "b": [1.0, float("inf")], "c": "x"}) == {"a": None, "b": [1.0, None], "c": "x"}
    code, _ = _eval(["--prompts", str(_prompt_file(tmp_path)), "--reward", "tests.helpers:half_nan", "--seeds", "0",
                     "--steps", "2", "--csv", str(tmp_path / "e.csv")], capsys)
    assert code == 0
    json.loads((tmp_path / "e.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))


def _prompt_file(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("a red circle on a blue background\n")
    return path


def test_compare_refuses_a_run_of_another_lora_rank_before_evaluating_any(tmp_path, capsys, monkeypatch):
    from flowrl.trainer import Trainer

    runs = []
    for rank in (4, 8):
        runs.append(Trainer(load_config("configs/tiny_flow_grpo.yaml", [
            *FAST, "train.iterations=1", f"train.lora.rank={rank}", f"log.output_dir={tmp_path}",
            f"log.run_name=r{rank}"])).train())
    sampled = []
    monkeypatch.setattr("flowrl.evaluate.reward_table", lambda *a, **k: sampled.append(a))
    from flowrl.cli import main

    code = main(["eval", "configs/tiny_flow_grpo.yaml", "train.lora.rank=4", "--compare", str(runs[0]), str(runs[1]),
                 "--prompts", str(_prompt_file(tmp_path)), "--reward", "jpeg_incompressibility",
                 "--csv", str(tmp_path / "c.csv")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and "rank 8" in err[0] and not sampled


# ------------------------------------------------------------------------------------------ H: reward ranges
def test_geneval_metadata_is_checked_when_the_prompts_load():
    from flowrl.rewards.geneval import metadata_problem
    from flowrl.rewards.registry import RewardError, RewardSet

    good = {"tag": "position", "include": [{"class": "cat", "count": 1},
                                           {"class": "dog", "count": 1, "position": ["left of", 0]}]}
    assert metadata_problem(good) is None and metadata_problem({}) is None  # no clauses: scored NaN, masked
    assert "count" in metadata_problem({"include": [{"class": "cat"}]})
    assert "count" in metadata_problem({"include": [{"class": "cat", "count": -3}]})
    assert "position" in metadata_problem({"include": [{"class": "cat", "count": 1, "position": ["near", 0]}]})

    geneval_rule = metadata_problem

    class Checks:  # a reward that declares what metadata it needs, as the geneval reward does
        metadata_problem = staticmethod(geneval_rule)

        def __call__(self, images, prompts, metadata=None):
            return torch.zeros(len(images))

    rewards = RewardSet([("geneval", 1.0, Checks())])
    rewards.check_metadata(["a cat and a dog"], [good])
    with pytest.raises(RewardError) as err:
        rewards.check_metadata(["a cat", "three cats"], [good, {"include": [{"class": "cat", "count": -3}]}])
    assert "prompt 1" in _one_line(err) and "geneval" in str(err.value)


def test_scores_outside_a_reward_s_declared_range_are_masked_and_a_judge_s_out_of_scale_answer_fails():
    from flowrl.rewards.registry import RewardSet
    from flowrl.rewards.vlm_judge import VLMJudge

    class Bounded:
        score_range = (0.0, 1.0)

        def __call__(self, images, prompts, metadata=None):
            return torch.tensor([0.5, 9999.9, -2.0])

    out = RewardSet([("bounded", 1.0, Bounded())])(torch.rand(3, 3, 8, 8), ["a", "b", "c"])
    assert out.invalid.tolist() == [False, True, True] and out.total[0] == 0.5 and out.total[1:].isnan().all()
    judge = VLMJudge(url="http://127.0.0.1:9/v1", retries=0)
    judge._post = lambda body: "Score: 99999"
    assert judge.judge(torch.rand(3, 8, 8), "a cat", {}) != judge.judge(torch.rand(3, 8, 8), "a cat", {})  # NaN
    assert judge.failures == 2
    judge._post = lambda body: "Score: 7"
    assert judge.judge(torch.rand(3, 8, 8), "a cat", {}) == pytest.approx(0.7)


# ------------------------------------------------------------------------------------------ smaller
def test_a_reward_model_the_hub_cannot_serve_is_refused_at_once(monkeypatch):
    """No network (an endpoint that refuses connections): a detector by hub id not in the cache is one line
    before the hub client's retries, not minutes later."""
    from flowrl.rewards.geneval import GenEvalReward
    from flowrl.rewards.loading import hub_reachable
    from flowrl.rewards.registry import RewardError

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    for flag in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "FLOWRL_OFFLINE"):  # the hub allowed, but unreachable
        monkeypatch.delenv(flag, raising=False)
    assert not hub_reachable()
    with pytest.raises(RewardError) as err:
        GenEvalReward(detector="someone/a-detector-nobody-cached")
    assert "cannot be reached" in _one_line(err) and "hf download someone/a-detector-nobody-cached" in str(err.value)


def test_only_the_main_process_prints_a_config_refusal_under_a_launcher(monkeypatch, capsys):
    from flowrl.cli import main

    for rank, printed in (("0", 1), ("1", 0)):
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", rank)
        assert main(["train", "configs/tiny_flow_grpo.yaml", "train.seed=-1"]) == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == printed


def test_seed_lists_take_ranges_and_sample_reports_the_seeds_it_drew(tmp_path, capsys):
    from flowrl.cli import main, parse_seeds

    assert parse_seeds("16-19") == [16, 17, 18, 19] and parse_seeds("0,4-6,9") == [0, 4, 5, 6, 9]
    for bad in ("5-2", "1-x", "1,,2", "0-9999999"):
        with pytest.raises(FlowRLError):
            parse_seeds(bad)
    assert main(["sample", "configs/tiny_flow_grpo.yaml", "log.progress=false", "--prompt", "a red circle",
                 "--seeds", "0-2", "--steps", "2", "--out", str(tmp_path / "g.png")]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["seeds"] == [0, 1, 2] and report["columns"] == 3


def test_eval_counts_out_of_range_scores_as_invalid_and_bad_ranges_are_refused():
    """The reward table of `flowrl eval` masks a score just above the declared range as training does; an inverted
    or malformed range is refused in one line when the reward set is built."""
    from flowrl.errors import RewardError
    from flowrl.evaluate import reward_table
    from flowrl.rewards.registry import RewardSet

    class Bounded:
        score_range = (0.0, 1.0)

        def __call__(self, images, prompts, metadata=None):
            return torch.tensor([0.5, 1.0 + 1e-6])[: images.shape[0]]

    summary, _ = reward_table(lambda prompts, seeds: torch.rand(len(prompts) * len(seeds), 3, 8, 8), ["a"], [{}],
                              [0, 1], RewardSet([("bounded", 1.0, Bounded())]), progress=False)
    row = next(r for r in summary if r["metric"] == "bounded")
    assert (row["n"], row["invalid"], row["mean"]) == (1, 1, 0.5)
    for bad in ((1.0, 0.0), ("low", 1), (float("nan"), 1.0), (0.0,)):
        Bounded.score_range = bad
        with pytest.raises(RewardError, match="score_range"):
            RewardSet([("bounded", 1.0, Bounded())])
