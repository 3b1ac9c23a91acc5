"""What a run reads back and what it writes about itself: NaN is never a best point, damaged state files are
named and set aside (never a traceback), and one run folder has one writer."""

import json
import math
from pathlib import Path

import pytest

from flowrl.cli import main
from flowrl.config import load_config
from flowrl.errors import ConfigError
from flowrl.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent
FAST = ["sampler.num_steps=2", "train.prompts_per_iter=1", "algorithm.group_size=2", "log.progress=false",
        "log.sample_every=0", "guard.enabled=false"]


def test_nan_held_out_numbers_are_null_never_best_and_the_trained_weights_stay(tmp_path, capsys):
    code = main(["train", str(ROOT / "configs/tiny_flow_grpo.yaml"), f"log.output_dir={tmp_path}", "log.run_name=r",
                 *FAST, "train.iterations=2", "log.eval=tests.helpers:NaNCurve", "log.eval_every=1",
                 "log.keep_best=true"])
    err = capsys.readouterr().err
    assert code == 0, err
    run = tmp_path / "r"
    strict = lambda text: json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))  # noqa: E731
    ev = strict((run / "eval.json").read_text())
    assert ev["before"]["all"] is None and ev["after"]["all"] is None
    for line in (run / "eval_curve.jsonl").read_text().splitlines():
        assert strict(line)["all"] is None
    assert not (run / "best.json").exists() and not (run / "checkpoints" / "best").exists()
    assert "ends with its best" not in err and "held-out all is nan at iteration 0" in err


def test_a_damaged_best_eval_or_guard_file_is_named_and_set_aside_on_resume(tmp_path, capsys):
    base = ["train", str(ROOT / "configs/tiny_flow_grpo.yaml"), f"log.output_dir={tmp_path}", "log.run_name=r",
            *FAST[:-1], "log.eval=tests.helpers:ScriptedCurve", "log.eval_every=1", "log.save_every=1",
            "guard.every=1", "guard.num_prompts=1", "guard.seeds=[0, 1]"]
    assert main([*base, "train.iterations=1"]) == 0
    run = tmp_path / "r"
    for name in ("best.json", "eval.json", "guard.json"):
        text = (run / name).read_text()
        (run / name).write_text(text[: len(text) // 2])  # cut
    capsys.readouterr()
    assert main([*base, "train.iterations=2", "resume=latest"]) == 0
    err = capsys.readouterr().err
    for name in ("best.json", "eval.json", "guard.json"):
        assert f"{name} is damaged" in err and (run / f"{name}.damaged").is_file()
        json.loads((run / name).read_text())  # a whole one again
    assert "Traceback" not in err


def test_a_second_writer_to_the_same_run_is_refused(tmp_path):
    """Another process holding the run's lock (simulated here by a second open file description of the lock file,
    which flock treats as another holder) makes train refuse in one line; in one process a later trainer of the
    same run shares its lock, and the lock goes with the last of them."""
    import fcntl
    import os

    cfg = load_config(ROOT / "configs/tiny_flow_grpo.yaml", [f"log.output_dir={tmp_path}", "log.run_name=same",
                                                              *FAST, "train.iterations=1"])
    (tmp_path / "same").mkdir()
    lock = tmp_path / "same" / ".lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, b"4242")
    with pytest.raises(ConfigError, match=r"another flowrl train \(pid 4242\) is writing to"):
        Trainer(cfg)
    os.close(fd)
    first = Trainer(cfg)
    first.train()
    second = load_config(ROOT / "configs/tiny_flow_grpo.yaml", [f"log.output_dir={tmp_path}", "log.run_name=same",
                                                                 *FAST, "train.iterations=2", "resume=latest"])
    Trainer(second).train()  # the first trainer object is still alive: the same process shares its lock
    rows = [json.loads(x) for x in (tmp_path / "same" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1]
    assert all(math.isfinite(r["evaluations_cum"]) for r in rows)
    assert rows[1]["evaluations_cum"] > rows[0]["evaluations_cum"]
    del first
    import gc

    gc.collect()
    probe = os.open(lock, os.O_RDWR)
    fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released: another process could take it now
    os.close(probe)


def test_a_budget_in_evaluations_ends_the_run(tmp_path, capsys):
    code = main(["train", str(ROOT / "configs/tiny_flow_grpo.yaml"), f"log.output_dir={tmp_path}", "log.run_name=b",
                 *FAST, "train.iterations=50", "train.budget_evaluations=1"])
    assert code == 0
    rows = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1
    assert rows[0]["evaluations_cum"] == rows[0]["evaluations_rollout"] + rows[0]["evaluations_update"]
    assert "budget reached: 6 transformer evaluations of 1 after iteration 0" in capsys.readouterr().out
