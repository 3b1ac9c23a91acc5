"""Bad input, interruption and misuse as a careful user meets them: every case ends in one line that says what
to change (exit status 2, or 143 for SIGTERM), before work starts where that can be known, and no run's data
is lost: earlier checkpoints and metrics stay intact, and what a resume abandons is moved aside."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from flowrl.cli import main
from flowrl.report import read_metrics

ROOT = Path(__file__).resolve().parent.parent
FAST = ["sampler.num_steps=2", "train.prompts_per_iter=1", "algorithm.group_size=2", "log.progress=false",
        "log.sample_every=0"]


def cli(capsys, *args):
    """(exit status, stderr lines) of one `flowrl` command."""
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err.strip().splitlines()


def one_line(err, expected):
    """Exactly one error line and no traceback (the `run directory:` notice may precede it)."""
    errors = [e for e in err if e.startswith("flowrl: error:")]
    assert len(errors) == 1 and not any("Traceback" in e for e in err), err
    assert all(e.startswith(("flowrl: error:", "run directory:")) for e in err), err
    assert expected in errors[0], errors[0]


def train(capsys, out, name, *extra, config="configs/tiny_flow_grpo.yaml"):
    return cli(capsys, "train", ROOT / config, f"log.output_dir={out}", f"log.run_name={name}", *FAST, *extra)


def snapshot(run: Path) -> dict:
    """Every file of a run folder with its bytes, to assert that nothing changed."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def done_run(tmp_path_factory):
    """A finished 3-iteration LoRA run with checkpoints after iterations 1 and 2."""
    out = tmp_path_factory.mktemp("runs")
    assert main(["train", str(ROOT / "configs/tiny_flow_grpo.yaml"), f"log.output_dir={out}", "log.run_name=r",
                 *FAST, "train.iterations=3", "log.save_every=1"]) == 0
    return out / "r"


def copy_run(done_run, tmp_path) -> Path:
    dest = tmp_path / "runs" / "r"
    shutil.copytree(done_run, dest)
    return dest


# ------------------------------------------------------------------------------------------ run folders
def test_reusing_a_run_name_without_resume_is_refused(done_run, tmp_path, capsys):
    run = copy_run(done_run, tmp_path)
    before = snapshot(run)
    code, err = train(capsys, run.parent, "r", "train.iterations=2")
    assert code == 2
    one_line(err, f"{run} already holds a run (3 iterations logged, checkpoints up to iter_00002); continue it "
                  "with resume=latest log.run_name=r")
    assert snapshot(run) == before


def test_resume_with_no_iterations_left_is_refused(done_run, tmp_path, capsys):
    run = copy_run(done_run, tmp_path)
    before = snapshot(run)
    code, err = train(capsys, run.parent, "r", "train.iterations=3", "resume=latest")
    assert code == 2
    one_line(err, "ends at iteration 3 and train.iterations=3; raise train.iterations to continue the run")
    assert snapshot(run) == before  # config.yaml is not rewritten either


def test_resuming_an_older_checkpoint_moves_the_abandoned_branch_aside(done_run, tmp_path, capsys):
    run = copy_run(done_run, tmp_path)
    old_rows = read_metrics(run / "metrics.jsonl")
    old_last = (run / "checkpoints" / "iter_00002" / "pytorch_lora_weights.safetensors").read_bytes()
    code, err = train(capsys, run.parent, "r", "train.iterations=4", f"resume={run}/checkpoints/iter_00001",
                      "log.save_every=1")
    assert code == 0, err
    assert any("resuming at iteration 2; moved aside what came after it: 1 later checkpoint(s)" in e for e in err)
    (abandoned,) = (run / "checkpoints").glob("abandoned-*")
    assert (abandoned / "iter_00002" / "pytorch_lora_weights.safetensors").read_bytes() == old_last
    (rows_file,) = run.glob("metrics.abandoned-*.jsonl")
    assert read_metrics(rows_file) == old_rows[2:]  # the abandoned row 2 is kept, not deleted
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3] and rows[:2] == old_rows[:2]
    # resume=latest now continues the new branch, not the abandoned one
    code, err = train(capsys, run.parent, "r", "train.iterations=5", "resume=latest")
    assert code == 0 and [r["iteration"] for r in read_metrics(run / "metrics.jsonl")] == [0, 1, 2, 3, 4]


# ------------------------------------------------------------------------------------------ checkpoints
def damage(path: Path, how: str) -> None:
    if how == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif how == "garbage":
        path.write_bytes(b"\x00garbage" * 10)
    else:
        path.write_bytes(b"")


@pytest.mark.parametrize("file, how", [("pytorch_lora_weights.safetensors", "truncate"),
                                       ("pytorch_lora_weights.safetensors", "garbage"),
                                       ("pytorch_lora_weights.safetensors", "empty"),
                                       ("state.json", "garbage"), ("trainer_state.pt", "truncate"),
                                       ("trainer_state.pt", "empty")])
def test_a_damaged_checkpoint_falls_back_to_the_newest_intact_one(done_run, tmp_path, capsys, file, how):
    run = copy_run(done_run, tmp_path)
    damage(run / "checkpoints" / "iter_00002" / file, how)
    intact = snapshot(run / "checkpoints" / "iter_00001")
    # named directly: refused in one line that names the intact one
    code, err = train(capsys, run.parent, "r", "train.iterations=4", f"resume={run}/checkpoints/iter_00002")
    assert code == 2
    one_line(err, "damaged checkpoint (")
    assert f"the newest intact one is {run}/checkpoints/iter_00001" in err[0]
    # resume=latest: continues from the intact one and says so
    code, err = train(capsys, run.parent, "r", "train.iterations=3", "resume=latest")
    assert code == 0, err
    assert any("checkpoint iter_00002 is damaged" in e and "using iter_00001, the newest intact one" in e for e in err)
    assert snapshot(run / "checkpoints" / "iter_00001") == intact
    (abandoned,) = (run / "checkpoints").glob("abandoned-*/iter_00002")  # the damaged one is kept, moved aside
    assert [r["iteration"] for r in read_metrics(run / "metrics.jsonl")] == [0, 1, 2]


@pytest.mark.parametrize("override, field", [("model.tiny.num_layers=3", "model.tiny.num_layers=2 (this config: 3)"),
                                             ("train.lora.rank=4", "train.lora.rank=8 (this config: 4)")])
def test_a_checkpoint_of_another_model_names_the_differing_field(done_run, tmp_path, capsys, override, field):
    run = copy_run(done_run, tmp_path)
    before = snapshot(run)
    code, err = train(capsys, run.parent, "r", "train.iterations=4", "resume=latest", override)
    assert code == 2
    one_line(err, f"its weights do not fit this model; it was written with {field}")
    assert snapshot(run) == before
    # flowrl sample with the same mismatch fails too (it used to load and exit 0)
    code, err = cli(capsys, "sample", run / "config.yaml", override, "--checkpoint", run, "--out", tmp_path / "g.png")
    assert code == 2
    one_line(err, field)
    assert not (tmp_path / "g.png").exists()


# ------------------------------------------------------------------------------------------ validation
@pytest.mark.parametrize("override, expected", [
    ("sampler.noise_level=nan", "sampler.noise_level: 'nan' is not a finite number"),
    ("train.clip_range=.nan", "train.clip_range: nan is not a finite number"),
    ("advantage.clip=nan", "advantage.clip: 'nan' is not a finite number"),
    ("train.lr=nan", "train.lr: 'nan' is not a finite number"),
    ("train.lr=.inf", "train.lr: inf is not a finite number"),
    ("train.betas=[0.9, 1.5]", "train.betas: [0.9, 1.5] must be two numbers in [0, 1)"),
    ("model.resolution=17", "model.resolution: 17 px is not a multiple of 2"),
    ("data.sample_seeds=[]", "data.sample_seeds: list at least one seed"),
    ("log.eval_seeds=[]", "log.eval_seeds: list at least one seed"),
])
def test_bad_values_fail_before_any_work(tmp_path, capsys, override, expected):
    code, err = train(capsys, tmp_path / "runs", "x", override)
    assert code == 2
    one_line(err, expected)
    assert not (tmp_path / "runs").exists()


def test_mixed_precision_no_as_accelerate_documents_it(tmp_path):
    from flowrl.config import load_config

    f = tmp_path / "c.yaml"
    f.write_text("train:\n  mixed_precision: no\n")  # YAML 1.1 reads `no` as false
    assert load_config(f).train.mixed_precision == "no"


def test_a_full_size_preset_finds_its_prompt_file_from_any_folder(tmp_path, monkeypatch):
    from flowrl.config import load_config

    monkeypatch.chdir(tmp_path)
    cfg = load_config("configs/sd35m_flow_grpo.yaml")  # the shipped preset; its prompt file is a shipped asset
    assert Path(cfg.data.prompt_file).is_file() and Path(cfg.data.prompt_file).name == "animals.txt"


# ------------------------------------------------------------------------------------------ files and folders
def test_files_and_folders(tmp_path, capsys, done_run):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    code, err = train(capsys, blocker / "runs", "x")
    assert code == 2
    one_line(err, f"log.output_dir: {blocker} is a file, not a folder")
    code, err = train(capsys, "/proc/flowrl-test", "x")
    assert code == 2
    one_line(err, "log.output_dir: cannot write in /proc")
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle on a blue background\n")
    code, err = cli(capsys, "eval", ROOT / "configs/tiny_flow_grpo.yaml", "--prompts", prompts, "--reward",
                    "jpeg_incompressibility", "--csv", blocker / "e.csv")
    assert code == 2
    one_line(err, f"--csv: {blocker} is a file, not a folder")
    code, err = cli(capsys, "sample", ROOT / "configs/tiny_flow_grpo.yaml", "--out", blocker / "g.png")
    assert code == 2
    one_line(err, f"--out: {blocker} is a file, not a folder")
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("train:\n  lr: 1e-4  # caf\xe9\n".encode("latin-1"))
    code, err = cli(capsys, "train", latin, f"log.output_dir={tmp_path / 'r'}")
    assert code == 2
    one_line(err, "not UTF-8 text (byte 24); save the config as UTF-8")
    bad_prompts = tmp_path / "latin.txt"
    bad_prompts.write_bytes("caf\xe9 on a table\n".encode("latin-1"))
    code, err = train(capsys, tmp_path / "r", "x", f"data.prompt_file={bad_prompts}")
    assert code == 2
    one_line(err, "save the prompt file as UTF-8")
    assert not (tmp_path / "r").exists()
    code, err = cli(capsys, "compare", done_run, "--smoothing", "0")
    assert code == 2
    one_line(err, "argument --smoothing: 0 must be at least 1")


def test_a_damaged_metrics_line_is_skipped_and_named(done_run, tmp_path, capsys):
    run = copy_run(done_run, tmp_path)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[1] = lines[1][:40]  # a row cut in the middle
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    code = main(["compare", str(run), "--out", str(tmp_path / "cmp")])
    captured = capsys.readouterr()
    assert code == 0
    assert f"{run}/metrics.jsonl:2 is not a metrics row; skipped" in captured.err
    csv_rows = (tmp_path / "cmp" / "compare.csv").read_text().splitlines()[1:]
    assert [r.split(",")[3] for r in csv_rows] == ["0", "2"]  # the row after the damaged one is kept
    # resume keeps every valid row (it used to drop everything after the damaged line)
    code, err = train(capsys, run.parent, "r", "train.iterations=4", "resume=latest")
    assert code == 0
    assert [r["iteration"] for r in read_metrics(run / "metrics.jsonl")] == [0, 2, 3]


# ------------------------------------------------------------------------------------------ user rewards
@pytest.mark.parametrize("reward, expected", [
    ("tests.helpers:raises", "reward 'raises' failed: ValueError: the scorer's model is not loaded"),
    ("tests.helpers:returns_text", "reward 'returns_text' returned str 'good'; it must return one number per image"),
    ("tests.helpers:returns_none", "reward 'returns_none' returned NoneType 'None'; it must return one number"),
])
def test_user_reward_failures_are_named(tmp_path, capsys, reward, expected):
    code, err = train(capsys, tmp_path / "runs", "x", f"rewards=[{{name: '{reward}'}}]", "log.save_every=0")
    assert code == 2
    one_line(err, expected)
    assert not (tmp_path / "runs" / "x" / "metrics.jsonl").exists() or not read_metrics(tmp_path / "runs" / "x" / "metrics.jsonl")


# ------------------------------------------------------------------------------------------ signals
@pytest.mark.heavy
def test_sigterm_saves_a_checkpoint_and_the_resume_is_bit_identical(tmp_path):
    """SIGTERM mid-run: the iteration in progress finishes, a checkpoint is written, exit status 143; resuming
    from it gives the same metrics, row for row, as an uninterrupted run."""
    common = [str(ROOT / "configs/tiny_flow_grpo.yaml"), *FAST, "train.iterations=6", "log.save_every=0",
              "train.lora.enabled=false", "train.lr=1e-2", f"log.output_dir={tmp_path}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # both runs in a subprocess with the same thread count, so their float reductions match
    subprocess.run([sys.executable, "-m", "flowrl.cli", "train", *common, "log.run_name=full"], cwd=ROOT, env=env,
                   check=True, capture_output=True)
    proc = subprocess.Popen([sys.executable, "-m", "flowrl.cli", "train", *common, "log.run_name=cut"], cwd=ROOT,
                            env=env, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "cut" / "metrics.jsonl"
    deadline = time.time() + 240
    while len(read_metrics(metrics, warn=False)) < 2 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 143, err
    assert "flowrl: stopped: stopped by SIGTERM after iteration" in err.strip().splitlines()[-1]
    done = len(read_metrics(metrics))
    assert 2 <= done < 6 and (tmp_path / "cut" / "checkpoints" / f"iter_{done - 1:05d}" / "state.json").is_file()
    subprocess.run([sys.executable, "-m", "flowrl.cli", "train", *common, "log.run_name=cut", "resume=latest"],
                   cwd=ROOT, env=env, check=True, capture_output=True)
    skip = ("seconds", "peak_memory", "tflops_", "mfu_", "images_per_second")  # wall-clock times and rates
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(skip)} for r in rows]  # noqa: E731
    assert strip(read_metrics(metrics)) == strip(read_metrics(tmp_path / "full" / "metrics.jsonl"))


# ------------------------------------------------------------------------------------------ reward server
def raw_request(port: int, head: bytes, body: bytes = b"", wait: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as s:
        s.sendall(head + body)
        chunks = []
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
        except socket.timeout:
            pass
    return b"".join(chunks)


def test_the_reward_server_survives_abuse(capsys):
    from flowrl.rewards import build_reward
    from flowrl.rewards.remote import make_server

    srv = make_server("jpeg_incompressibility", {}, "127.0.0.1", 0, max_body_mb=1, timeout=0.5)
    port = srv.server_address[1]
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    remote = build_reward("remote", url=f"http://127.0.0.1:{port}", timeout=10, retries=1)
    images = torch.rand(2, 3, 8, 8)

    def still_serves():
        assert remote(images, ["a", "b"]).shape == (2,)

    try:
        post = b"POST /score HTTP/1.1\r\nHost: x\r\n"
        t0 = time.time()  # a body shorter than announced: cut off after the read timeout, not held for ever
        reply = raw_request(port, post + b"Content-Length: 1000\r\n\r\n", b"x" * 10)
        assert time.time() - t0 < 4 and (reply == b"" or b" 400 " in reply.split(b"\r\n")[0])
        still_serves()
        assert b" 400 " in raw_request(port, post + b"Content-Length: -5\r\n\r\n").split(b"\r\n")[0]
        assert b" 411 " in raw_request(port, post + b"\r\n").split(b"\r\n")[0]
        big = raw_request(port, post + f"Content-Length: {2 * 2**20}\r\n\r\n".encode())
        assert b" 413 " in big.split(b"\r\n")[0] and b"over the server's 1048576 byte limit" in big
        assert b" 400 " in raw_request(port, post + b"Content-Length: 4\r\n\r\n", b"junk").split(b"\r\n")[0]
        still_serves()
        # a busy port is one line
        code, err = cli(capsys, "serve-reward", "jpeg_incompressibility", "--port", port)
        assert code == 2
        one_line(err, f"cannot serve on 127.0.0.1:{port}: the port is in use; choose another --port")
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_write_that_fails_mid_run_is_one_line(tmp_path, capsys, monkeypatch):
    """A disk that fills up while a checkpoint is written: one line, and no half-written checkpoint in place."""
    import flowrl.checkpoint as ckpt_module

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device", str(tmp_path / "runs" / "x" / "checkpoints"))

    monkeypatch.setattr(ckpt_module.torch, "save", full_disk)
    code, err = train(capsys, tmp_path / "runs", "x", "train.iterations=1")
    assert code == 2
    one_line(err, "No space left on device; free space or choose another location")
    assert not list((tmp_path / "runs" / "x" / "checkpoints").glob("*iter_*"))  # nor a temporary one


def test_a_safetensors_full_disk_during_a_checkpoint_is_one_line(tmp_path, capsys, monkeypatch):
    """Full fine-tuning writes the transformer through safetensors, which reports a full disk as its own
    SafetensorError: still one line, and nothing half-written in place."""
    import safetensors.torch
    from safetensors import SafetensorError

    def full_disk(*args, **kwargs):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
                              'left on device" })')

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    code, err = train(capsys, tmp_path / "runs", "x", "train.iterations=1", "train.lora.enabled=false")
    assert code == 2
    one_line(err, "No space left on device; free space or choose another location")
    assert str(tmp_path / "runs" / "x" / "checkpoints" / "iter_00000") in err[-1]
    assert not list((tmp_path / "runs" / "x" / "checkpoints").glob("*iter_*"))  # nor a temporary one


def test_a_config_with_a_key_twice_is_one_line(tmp_path, capsys):
    """Two `train:` blocks: plain YAML keeps the later one silently; flowrl refuses before any work."""
    path = tmp_path / "twice.yaml"
    path.write_text("train:\n  lr: 1.0e-3\nsampler:\n  num_steps: 4\ntrain:\n  iterations: 3\n")
    code, err = cli(capsys, "train", path, f"log.output_dir={tmp_path / 'runs'}")
    assert code == 2
    one_line(err, f"{path}: key 'train' appears twice in one mapping (lines 1 and 5); keep one and merge")
    nested = tmp_path / "nested.yaml"
    nested.write_text("train:\n  lr: 1.0e-3\n  lr: 2.0e-3\n")
    code, err = cli(capsys, "train", nested)
    one_line(err, "key 'lr' appears twice in one mapping (lines 2 and 3)")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("command", ["sample", "eval"])
def test_a_seed_list_with_a_non_number_is_one_line(tmp_path, capsys, command):
    out = tmp_path / "grid.png"
    extra = ["--out", out] if command == "sample" else []
    code, err = cli(capsys, command, "--seeds", "0,a", *extra)
    assert code == 2
    one_line(err, "--seeds 0,a: 'a' is neither a seed nor a range; give seeds such as 0,1,2,3 or 16-31")
    assert not out.exists()


def test_serve_reward_refuses_images_with_nan_or_inf(capsys):
    """Non-finite pixels get a 400 naming them, not scores; finite ones are still scored."""
    from flowrl.rewards import build_reward
    from flowrl.rewards.remote import encode_request, make_server

    srv = make_server("jpeg_incompressibility", {}, "127.0.0.1", 0)
    port = srv.server_address[1]
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        images = torch.rand(3, 3, 8, 8)
        images[1, 0, 0, 0], images[2, 1, 2, 3] = float("nan"), float("inf")
        body = encode_request(images, ["a", "b", "c"], None)
        head = f"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        reply = raw_request(port, head, body)
        assert b" 400 " in reply.split(b"\r\n")[0]
        assert b"the images hold 2 NaN or inf values; send finite pixel values in [0, 1]" in reply
        remote = build_reward("remote", url=f"http://127.0.0.1:{port}", timeout=10, retries=1)
        assert remote(torch.rand(2, 3, 8, 8), ["a", "b"]).shape == (2,)
    finally:
        srv.shutdown()
        srv.server_close()


def test_serve_reward_answers_a_request_with_no_images():
    """A request of 0 images gets a 400 that says so (the handler used to crash and the client got no answer)."""
    from flowrl.rewards.remote import encode_request, make_server

    srv = make_server("jpeg_incompressibility", {}, "127.0.0.1", 0)
    port = srv.server_address[1]
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        body = encode_request(torch.zeros(0, 3, 8, 8), [], None)
        head = f"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        reply = raw_request(port, head, body)
        assert b" 400 " in reply.split(b"\r\n")[0] and b"hold no pixels: send at least one image" in reply
    finally:
        srv.shutdown()
        srv.server_close()
