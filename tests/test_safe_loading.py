"""Nothing in a run folder runs code when it is loaded: a sharded checkpoint's DCP metadata and its non-tensor
entries are read by unpicklers that admit only data (torch's own DCP reader would run a crafted file's code, shown
here with a marker file), and a run's name stays one folder inside log.output_dir."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from flowrl.errors import ConfigError, FlowRLError


class _RunsCode:
    """Pickles as a call of os.system: loading it creates the marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _genuine(ckpt, extra=None):
    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.arange(6.0).view(2, 3)}, "optimizer": {"param_groups": [{"lr": 1e-4, "betas": (0.9, 0.99)}]}}
    if extra is not None:
        state["extra"] = extra
    dcp.save(state, checkpoint_id=str(ckpt / "sharded"), no_dist=True)


def test_a_genuine_sharded_checkpoint_loads_its_tensors_and_plain_entries(tmp_path):
    from flowrl.sharded_checkpoint import load_dcp, read_sharded_metadata

    _genuine(tmp_path)
    assert "model.w" in read_sharded_metadata(tmp_path).state_dict_metadata
    state = {"model": {"w": torch.zeros(2, 3)}, "optimizer": {"param_groups": [{"lr": 0.0, "betas": (0.0, 0.0)}]}}
    load_dcp(state, tmp_path, no_dist=True)
    assert torch.equal(state["model"]["w"], torch.arange(6.0).view(2, 3))
    assert state["optimizer"]["param_groups"][0] == {"lr": 1e-4, "betas": (0.9, 0.99)}


def test_a_crafted_metadata_file_is_refused_before_it_runs(tmp_path):
    import torch.distributed.checkpoint as dcp

    from flowrl.sharded_checkpoint import load_sharded_weights, read_sharded_metadata

    _genuine(tmp_path)
    marker = tmp_path / "ran"
    (tmp_path / "sharded" / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    for load in (lambda: read_sharded_metadata(tmp_path),
                 lambda: load_sharded_weights(torch.nn.Linear(3, 2), tmp_path)):  # export / sample of a full run
        with pytest.raises(FlowRLError) as err:
            load()
        assert "posix.system" in str(err.value) and "\n" not in str(err.value)
        assert not marker.exists()
    # torch's own reader runs it: the file is a real attack, not a malformed one
    with pytest.raises(BaseException):  # DCP's CheckpointException is a BaseException
        dcp.load({"model": {"w": torch.zeros(2, 3)}}, checkpoint_id=str(tmp_path / "sharded"), no_dist=True)
    assert marker.exists()


def test_a_crafted_entry_inside_the_shards_is_refused_before_it_runs(tmp_path):
    import torch.distributed.checkpoint as dcp

    from flowrl.sharded_checkpoint import load_dcp

    marker = tmp_path / "ran"
    _genuine(tmp_path, extra=_RunsCode(marker))
    with pytest.raises(FlowRLError) as err:
        load_dcp({"model": {"w": torch.zeros(2, 3)}, "extra": None}, tmp_path, no_dist=True)
    assert "extra" in str(err.value) and "\n" not in str(err.value) and not marker.exists()
    dcp.load({"model": {"w": torch.zeros(2, 3)}, "extra": None}, checkpoint_id=str(tmp_path / "sharded"), no_dist=True)
    assert marker.exists()  # DCP's default planner unpickles it with weights_only=False


@pytest.mark.parametrize("name", ["../../x", "/tmp/elsewhere", "..", ".", "a/b", "a\\b"])
def test_a_run_name_is_one_folder_name(name):
    from flowrl.config import load_config

    with pytest.raises(ConfigError) as err:
        load_config("configs/tiny_flow_grpo.yaml", [f"log.run_name={name}"])
    assert str(err.value).startswith("log.run_name:") and "\n" not in str(err.value)


def test_a_folder_flowrl_did_not_make_is_never_a_run_folder(tmp_path):
    """A user's folder with a config.yaml but no metrics is refused before any work, and its file is untouched; a
    run folder flowrl made (its marker) that never logged an iteration is taken again."""
    from flowrl.config import load_config
    from flowrl.trainer import Trainer

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("my own notes\n")
    common = ["train.iterations=1", "train.prompts_per_iter=2", f"log.output_dir={tmp_path}", "log.sample_every=0",
              "log.progress=false", "log.eval=none"]
    with pytest.raises(ConfigError) as err:
        Trainer(load_config("configs/tiny_flow_grpo.yaml", [*common, "log.run_name=mine"]))
    assert "no flowrl run wrote" in str(err.value) and "\n" not in str(err.value)
    assert (mine / "config.yaml").read_text() == "my own notes\n" and sorted(p.name for p in mine.iterdir()) == ["config.yaml"]
    run = Trainer(load_config("configs/tiny_flow_grpo.yaml", [*common, "log.run_name=fresh"]))
    assert (tmp_path / "fresh/.flowrl-run").is_file()  # written when the folder opens
    (tmp_path / "fresh/metrics.jsonl").unlink(missing_ok=True)  # as if it had stopped before its first iteration
    del run
    Trainer(load_config("configs/tiny_flow_grpo.yaml", [*common, "log.run_name=fresh"]))


def test_a_failed_write_leaves_nothing_behind_and_the_old_file_whole(tmp_path):
    """A full disk half way through a write: the destination keeps its old content and no temporary file stays
    (every run-folder file, sample grid and plot is written through flowrl.report.atomic_path)."""
    import errno
    from pathlib import Path

    import matplotlib.pyplot as plt

    from flowrl.report import atomic_path, save_figure

    target = tmp_path / "metrics.csv"
    target.write_bytes(b"old")
    with pytest.raises(OSError):
        with atomic_path(target) as tmp:
            tmp.write_bytes(b"ne")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["metrics.csv"]

    def half_then_full(path, **_):
        Path(path).write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    fig = plt.figure()
    fig.savefig = half_then_full
    samples = tmp_path / "samples"
    samples.mkdir()
    with pytest.raises(OSError):
        save_figure(fig, samples / "iter_00000.png")
    assert list(samples.iterdir()) == []


def _flip_tensor_bytes(path, count: int = 8) -> None:
    """Flip ``count`` bytes inside a safetensors file's tensor data (the size and the header stay as they were)."""
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little") + 16
    data[start:start + count] = bytes(b ^ 0xFF for b in data[start:start + count])
    path.write_bytes(bytes(data))


def test_a_flipped_byte_in_saved_weights_is_caught_before_any_weight_is_used(tmp_path, capsys):
    """Every checkpoint records its files' SHA-256; a LoRA file with 8 flipped bytes (same size, a valid header) is
    refused by export, sample and an explicit resume, and resume=latest continues from the newest intact one."""
    import json

    from flowrl.checkpoint import LORA_FILE
    from flowrl.cli import main
    from flowrl.config import load_config
    from flowrl.trainer import Trainer

    common = ["train.prompts_per_iter=2", f"log.output_dir={tmp_path}", "log.run_name=r", "log.sample_every=0",
              "log.progress=false", "log.eval=none", "log.save_every=1"]
    Trainer(load_config("configs/tiny_flow_grpo.yaml", [*common, "train.iterations=2"])).train()
    run = tmp_path / "r"
    newest = run / "checkpoints/iter_00001"
    assert json.loads((newest / "digests.json").read_text())[LORA_FILE]
    _flip_tensor_bytes(newest / LORA_FILE)
    capsys.readouterr()
    for argv in (["export", str(newest), "--out", str(tmp_path / "lora")],
                 ["sample", "configs/tiny_flow_grpo.yaml", "--checkpoint", str(newest), "--prompt", "a red circle",
                  "--seeds", "0", "--out", str(tmp_path / "s.png")]):
        assert main(argv) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "damaged checkpoint" in err[0] and "SHA-256" in err[0], err
    assert not (tmp_path / "lora").exists() and not (tmp_path / "s.png").exists()
    Trainer(load_config("configs/tiny_flow_grpo.yaml", [*common, "train.iterations=3", "resume=latest"])).train()
    assert "iter_00001 is damaged" in capsys.readouterr().err  # named, and the run continued from iteration 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2] and all(r["reward_mean/total"] == r["reward_mean/total"] for r in rows)


SHARDED = ["train.prompts_per_iter=2", "log.sample_every=0", "log.progress=false", "log.eval=none", "log.save_every=1",
           "train.fsdp.enabled=true", "log.run_name=r"]


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    """Two iterations of a sharded (FSDP, one process) run with a checkpoint after each, trained once."""
    from flowrl.config import load_config
    from flowrl.trainer import Trainer

    out = tmp_path_factory.mktemp("sharded")
    Trainer(load_config("configs/tiny_flow_grpo.yaml", [*SHARDED, f"log.output_dir={out}", "train.iterations=2"])).train()
    return out / "r"


@pytest.mark.parametrize("damage", ["cut a shard", "delete a shard", "cut the metadata"])
def test_a_damaged_sharded_checkpoint_is_named_and_the_newest_intact_one_resumes(tmp_path, capsys, damage,
                                                                                 sharded_run):
    import json
    import shutil

    from flowrl.config import load_config
    from flowrl.trainer import Trainer

    shutil.copytree(sharded_run, tmp_path / "r")
    sharded = tmp_path / "r/checkpoints/iter_00001/sharded"
    shard = sorted(sharded.glob("*.distcp"))[0]
    if damage == "cut a shard":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif damage == "delete a shard":
        shard.unlink()
    else:
        meta = sharded / ".metadata"
        meta.write_bytes(meta.read_bytes()[:40])
    capsys.readouterr()
    Trainer(load_config("configs/tiny_flow_grpo.yaml", [*SHARDED, f"log.output_dir={tmp_path}", "train.iterations=3",
                                                        "resume=latest"])).train()
    err = capsys.readouterr().err
    assert "checkpoint iter_00001 is damaged" in err and "using iter_00000" in err and "Traceback" not in err
    rows = [json.loads(line) for line in (tmp_path / "r/metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2]


@pytest.mark.parametrize("iterations, saved_at, stopped_after", [(3, 0, 0), (1, 0, 0)])
def test_a_sigterm_during_a_checkpoint_save_stops_right_after_it(tmp_path, iterations, saved_at, stopped_after):
    """The signal arrives while iteration ``saved_at``'s checkpoint is written: the run stops as soon as the save is
    complete (not one iteration later), and one that arrives during the last save still ends in exit status 143."""
    import json
    import signal

    from flowrl.config import load_config
    from flowrl.errors import Stopped
    from flowrl.trainer import Trainer

    trainer = Trainer(load_config("configs/tiny_flow_grpo.yaml", [
        "train.prompts_per_iter=2", f"log.output_dir={tmp_path}", "log.run_name=r", "log.sample_every=0",
        "log.progress=false", "log.eval=none", "log.save_every=1", f"train.iterations={iterations}"]))
    save = trainer.save

    def save_then_signal(it):
        path = save(it)
        if it == saved_at:
            os.kill(os.getpid(), signal.SIGTERM)  # caught by the trainer's handler, as a scheduler's would be
        return path

    trainer.save = save_then_signal
    with pytest.raises(Stopped) as stop:
        trainer.train()
    assert stop.value.exit_code == 143 and "\n" not in str(stop.value)
    rows = [json.loads(line) for line in (tmp_path / "r/metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(stopped_after + 1))
    assert (tmp_path / f"r/checkpoints/iter_{stopped_after:05d}/digests.json").is_file()


def test_a_metadata_file_holding_a_plain_number_is_one_line(tmp_path):
    from flowrl.sharded_checkpoint import read_sharded_metadata

    _genuine(tmp_path)
    (tmp_path / "sharded" / ".metadata").write_bytes(pickle.dumps(5))
    with pytest.raises(FlowRLError, match=r"holds a int, not a checkpoint's metadata") as err:
        read_sharded_metadata(tmp_path)
    assert "\n" not in str(err.value)


def test_a_cut_shard_without_digests_falls_back_to_the_older_checkpoint(tmp_path):
    """An older-layout sharded checkpoint (no digests.json): a shard cut short is named, and the run's newest intact
    checkpoint is the older one, as with digests."""
    import json

    from flowrl.checkpoint import checkpoint_problem, latest_checkpoint

    run = tmp_path / "run"
    for it in (0, 1):
        ckpt = run / "checkpoints" / f"iter_{it:05d}"
        ckpt.mkdir(parents=True)
        _genuine(ckpt)
        (ckpt / "state.json").write_text(json.dumps({"iteration": it, "sharded": True, "lora": False}))
        assert checkpoint_problem(ckpt) is None
    shard = next((run / "checkpoints" / "iter_00001" / "sharded").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])
    assert "is cut short" in checkpoint_problem(shard.parent.parent)
    assert latest_checkpoint(run, quiet=True).name == "iter_00000"
