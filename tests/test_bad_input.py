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
@pytest.mark.parametrize("content", ['{"micro_batch": ', '{"micro_batch": "four"}', '{"micro_batch": -5}',
                                     "\x00\x01\x02binary", '{"micro_batch": true}'])
def test_a_damaged_micro_batch_file_is_one_line_before_the_model_loads(tmp_path, content, monkeypatch):
    from flowrl import trainer as trainer_module
    from flowrl.trainer import Trainer

    common = [*FAST, f"log.output_dir={tmp_path}", "log.run_name=auto", "train.micro_batch=auto", "log.save_every=1"]
    Trainer(load_config("configs/tiny_flow_grpo.yaml", [*common, "train.iterations=1"])).train()
    (tmp_path / "auto/micro_batch.json").write_text(content)
    loads = []
    monkeypatch.setattr(trainer_module, "load_adapter", lambda *a, **k: loads.append(a))
    with pytest.raises(ConfigError) as err:
        Trainer(load_config("configs/tiny_flow_grpo.yaml", [*common, "train.iterations=2", "resume=latest"]))
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
