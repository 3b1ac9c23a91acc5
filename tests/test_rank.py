"""`flowrl rank`: the ranked preset table by hand (mean gain +- standard error over seeds, significance against the
baseline at two standard errors of the difference), and `flowrl compare --band se`."""

import json
import math

import pytest
import yaml

from flowrl.cli import main


def _run(root, label, seed, before, after, noise=(5.0, 6.0), seconds=400.0, rollouts=3840):
    rd = root / f"{label}-seed{seed}"
    rd.mkdir(parents=True)
    (rd / "config.yaml").write_text(yaml.safe_dump({"train": {"seed": seed}, "algorithm": {"name": "flow_grpo"},
                                                    "log": {"run_name": rd.name}}))
    (rd / "eval.json").write_text(json.dumps({
        "before": {"all": before, "reward": 0.87, "background_noise": noise[0]},
        "after": {"all": after, "reward": 0.9, "background_noise": noise[1]},
        "about": {"headline": "all", "watch": "background_noise"}}))
    rows = [{"iteration": i, "seconds_cum": seconds * (i + 1) / 2, "rollouts_cum": rollouts * (i + 1) / 2,
             "reward_mean/total": 0.8} for i in range(2)]
    (rd / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (rd / "eval_curve.jsonl").write_text("".join(json.dumps({"iteration": i, "all": before + i * (after - before),
                                                             "reward": 0.9, "seconds_cum": 100.0 * i,
                                                             "rollouts_cum": 100 * i}) + "\n" for i in range(2)))
    return rd


def test_rank_table_by_hand(tmp_path, capsys):
    runs = [_run(tmp_path, "base", s, 0.60, 0.60 + g) for s, g in enumerate((0.05, 0.07, 0.06))]
    runs += [_run(tmp_path, "better", s, 0.60, 0.60 + g, noise=(5.0, 9.0)) for s, g in enumerate((0.10, 0.12, 0.11))]
    runs += [_run(tmp_path, "noisy", s, 0.60, 0.60 + g) for s, g in enumerate((0.06, 0.0, 0.12))]
    runs += [_run(tmp_path, "single", 0, 0.60, 0.70)]
    assert main(["rank", *map(str, runs), "--out", str(tmp_path / "rank")]) == 0
    text = capsys.readouterr().out
    from flowrl.report import rank_runs

    table, base = rank_runs(runs)
    assert base == "base"
    rows = {r["label"]: r for r in table}
    assert [r["label"] for r in table] == ["better", "single", "base", "noisy"]  # by mean gain (noisy ties base)
    se = 0.01 / math.sqrt(3)  # gains 5, 7, 6 points: sample std 1 point
    assert rows["base"]["gain_mean"] == pytest.approx(0.06) and rows["base"]["gain_se"] == pytest.approx(se)
    assert rows["better"]["diff_vs_baseline"] == pytest.approx(0.05)
    assert rows["better"]["significant"] is True  # 5 points > 2 x sqrt(2) x 0.577 = 1.63
    assert rows["noisy"]["gain_se"] == pytest.approx(0.06 / math.sqrt(3)) and not rows["noisy"]["se_ok"]
    assert rows["noisy"]["significant"] is False
    assert rows["single"]["gain_se"] is None and rows["single"]["significant"] is None
    assert rows["better"]["watch_change"] == pytest.approx(4.0) and rows["base"]["seconds"] == pytest.approx(400.0)
    assert "| 1 | better | 3 | +11.0 +- 0.6 | 60.0% -> 71.0% | 0.900 | +4.0 | 2 | - | 400 | 3840 | +5.0 (> 2 SE) |" in text
    assert "| 4 | noisy | 3 | +6.0 +- 3.5 (> 1.5) |" in text and "+0.0 (within 2 SE) |" in text
    assert (tmp_path / "rank" / "rank.md").read_text().strip() == text.strip()


def test_rank_skips_unfinished_runs_and_needs_one_finished(tmp_path, capsys):
    """runs/*/ may hold runs without a held-out evaluation: each is named and skipped; with none finished, one line."""
    done = _run(tmp_path, "done", 0, 0.6, 0.7)
    rd = _run(tmp_path, "x", 0, 0.6, 0.7)
    data = json.loads((rd / "eval.json").read_text())
    del data["after"]
    (rd / "eval.json").write_text(json.dumps(data))
    assert main(["rank", str(rd)]) != 0
    assert "none of the 1 runs has an eval.json with 'before' and 'after'" in capsys.readouterr().err
    assert main(["rank", str(done), str(rd), "--out", str(tmp_path / "rank")]) == 0
    captured = capsys.readouterr()
    assert f"skipped 1 run(s) without a finished held-out evaluation (eval.json with 'before' and 'after'): {rd}" \
        in captured.err and "| done |" in captured.out


def test_compare_band_se(tmp_path, capsys):
    runs = [_run(tmp_path, "base", s, 0.60, 0.60 + g) for s, g in enumerate((0.05, 0.07, 0.06))]
    assert main(["compare", *map(str, runs), "--metric", "heldout/all", "--band", "se", "--out",
                 str(tmp_path / "cmp")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (tmp_path / "cmp" / "compare.png").stat().st_size > 0
    assert out["summary"][0]["final_mean"] == pytest.approx(0.66)


def test_compare_many_labels_draws_one_panel_each_with_the_first_behind(tmp_path, monkeypatch):
    """Beyond ten labels the colour cycle repeats, so each label gets its own panel, the first label in grey."""
    import flowrl.report.runs as report_runs

    figures = []
    monkeypatch.setattr(report_runs, "save_figure", lambda fig, path: (figures.append(fig), path.write_bytes(b"")))
    runs = [_run(tmp_path, f"m{i:02d}", s, 0.6, 0.7) for i in range(12) for s in range(2)]
    report_runs.compare_runs(runs, tmp_path / "cmp", band="se")
    axes = [ax for ax in figures[0].axes if ax.get_visible()]
    assert [ax.get_title() for ax in axes] == [f"m{i:02d} (2)" for i in range(12)]  # 12 panels of a 3 x 5 grid
    assert len(figures[0].axes) == 15
    assert [len(ax.lines) for ax in axes] == [1] + [2] * 11  # each label's mean, and the first label's behind it
    assert axes[3].lines[0].get_color() == "0.6"

    figures.clear()
    report_runs.compare_runs(runs[:20], tmp_path / "cmp10", band="se")  # ten labels: one axes, ten colours
    assert len(figures[0].axes) == 1 and len(figures[0].axes[0].lines) == 10


def test_a_plan_claims_each_folder_when_it_starts_it_and_never_deletes_a_run(tmp_path):
    """Two plans may share an output folder, and a plan's first look may be hours old: just before a run starts,
    a folder finished since then is kept as it is, one another live process writes is left to it, and an unfinished
    one nobody writes is moved under logs/interrupted/ with its files, not deleted."""
    import fcntl
    import os

    from flowrl.report.plan import claim_folder

    done = tmp_path / "a-s0"
    done.mkdir()
    (done / "eval.json").write_text(json.dumps({"before": {"all": 0.5}, "after": {"all": 0.6}}))
    assert claim_folder(tmp_path, "a-s0") == "finished" and (done / "eval.json").is_file()

    busy = tmp_path / "b-s0"
    busy.mkdir()
    (busy / "metrics.jsonl").write_text('{"iteration": 0}\n')
    fd = os.open(busy / ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a writer holds the run (another open file: a lock conflict)
    try:
        assert claim_folder(tmp_path, "b-s0") == "busy" and (busy / "metrics.jsonl").is_file()
    finally:
        os.close(fd)
    assert claim_folder(tmp_path, "b-s0") == "ready" and not busy.exists()  # its writer gone: set aside
    aside = list((tmp_path / "logs" / "interrupted").iterdir())
    assert [p.name.startswith("b-s0-") for p in aside] == [True]
    assert (aside[0] / "metrics.jsonl").read_text() == '{"iteration": 0}\n'
    assert claim_folder(tmp_path, "c-s0") == "ready"  # nothing there
