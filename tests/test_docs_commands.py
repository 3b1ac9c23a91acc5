"""Every shell command that getting-started.md, benchmarks.md and extending.md print and that runs on a CPU, run as
printed in a subprocess from an empty folder (the installed ``flowrl`` script, nothing on PYTHONPATH).

Long jobs are shortened by overrides appended after the printed command (a few iterations, one held-out seed) or by
the explicit substitutions in ``SHORTER`` (fewer rounds); placeholders (``S``, ``runs/<run>``) are filled in. What
cannot run here (set-up, GPUs, real checkpoints, hours of training) is listed in ``NOT_HERE`` with the reason, and
a command that falls in neither list fails the test: a new command on a page is either run or explained.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = ("docs/getting-started.md", "docs/benchmarks.md", "docs/extending.md")

# a command starting with one of these does not run on this machine, for the reason given
NOT_HERE = {
    "git clone": "needs the network",
    "make ": "set-up targets: `make test` is this suite, `make demo` is `flowrl train configs/tiny_default.yaml`",
    "pip install": "installs packages (the wheel's install is tests/test_install.py)",
    "accelerate launch": "needs several GPUs",
    "flowrl gpu-check": "needs a CUDA device (its --tiny form runs in tests/test_gpu_check*)",
    "flowrl bench-gpu": "needs a CUDA device (its --tiny form runs in tests/test_cli.py)",
    "flowrl train configs/sd35m_": "needs the published weights",
    "flowrl sample configs/sd35m_": "needs the published weights and a run of them",
    "flowrl rank --plan": "trains 95 runs, about 3 hours (the plan's code path runs in tests/test_rank_plan.py)",
    "flowrl train configs/my_": "the page's own placeholder config",
}
# printed -> run: the same command with less work
SHORTER = {"--rounds 3": "--rounds 1", "--memory 300": "--memory 3"}
# appended to every `flowrl train` (and the plug-in ones): a short run with a one-seed held-out evaluation
SHORT_TRAIN = ["train.iterations=2", "train.prompts_per_iter=2", "log.sample_every=0", "log.progress=false",
               "log.eval_seeds=[0]", "log.eval_curve_seeds=1", "log.eval_every=1", "log.save_every=0"]


def page_commands(page: str) -> list[str]:
    """The commands of the page's ```bash blocks: continuation lines joined, comments and blank lines dropped."""
    text = (ROOT / page).read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()
            if line and not line.startswith("#"):
                commands.append(re.sub(r"\s+", " ", line))
    return commands


def bare(command: str) -> str:
    """The command without leading environment assignments (``OMP_NUM_THREADS=1 flowrl train ...``)."""
    return re.sub(r"^(?:[A-Z_][A-Z0-9_]*=\S+\s+)+", "", command)


def reason_not_run(command: str) -> str | None:
    return next((why for prefix, why in NOT_HERE.items() if bare(command).startswith(prefix)), None)


def test_every_printed_command_is_run_or_explained():
    """The classification alone (fast): each command is either in NOT_HERE or one this suite's heavy test runs."""
    runnable = [c for p in PAGES for c in page_commands(p) if reason_not_run(c) is None]
    assert all(bare(c).startswith("flowrl ") for c in runnable), [c for c in runnable
                                                                  if not bare(c).startswith("flowrl ")]
    assert len(runnable) >= 14


@pytest.mark.heavy
def test_the_pages_commands_run_as_printed(tmp_path):
    """Run every runnable command of the three pages in order of the pages, in one folder (the train commands
    leave runs the later eval / export / compare / rank commands read), and count them."""
    script_dir = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{script_dir}{os.pathsep}{env.get('PATH', '')}"

    def run(command: str) -> subprocess.CompletedProcess:
        done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=900)
        assert done.returncode == 0, (command, done.stdout[-1500:], done.stderr[-3000:])
        return done

    # the runs `flowrl compare runs/a-seed0 ... --metric heldout/all` and `flowrl rank --baseline a` read
    for label, lr in (("a", "3e-4"), ("b", "1e-4")):
        for seed in (0, 1):
            run(" ".join(["flowrl train configs/tiny_default.yaml", f"train.seed={seed}", f"train.lr={lr}",
                          f"log.run_name={label}-seed{seed}", *SHORT_TRAIN]))
    # the plug-in modules extending.md's commands name, written where the commands run
    extending = (ROOT / "docs/extending.md").read_text()
    for code in re.findall(r"<!-- example: [\w-]+ -->\s*```python\n(.*?)```", extending, re.S):
        module = re.match(r"# (\w+)\.py\n", code)
        if module:
            (tmp_path / f"{module.group(1)}.py").write_text(code)

    ran, seen = [], set()
    for page in PAGES:
        for command in page_commands(page):
            if reason_not_run(command) is not None or command in seen:
                continue
            seen.add(command)
            last_run = max((p for p in (tmp_path / "runs").iterdir() if p.name.startswith("tiny_default")),
                           key=lambda p: p.stat().st_mtime, default=None)
            concrete = command.replace("train.seed=S", "train.seed=0")
            if "runs/<run>" in concrete:
                assert last_run is not None, command
                concrete = concrete.replace("runs/<run>", f"runs/{last_run.name}")
            for printed, shorter in SHORTER.items():
                concrete = concrete.replace(printed, shorter)
            argv = shlex.split(bare(concrete))
            if argv[:2] == ["flowrl", "train"]:
                concrete += " " + " ".join(SHORT_TRAIN)
            run(concrete)
            ran.append(command)
    print(f"{len(ran)} commands run as printed:", *ran, sep="\n  ")
    assert len(ran) >= 14
    assert (tmp_path / "my-lora").is_dir() and (tmp_path / "flowrl.schema.json").stat().st_size > 1000


@pytest.mark.heavy
def test_the_python_quickstart_runs_as_printed(tmp_path):
    """docs/python.md's code, as a script in an empty folder: it trains, prints one reward per iteration and writes
    the grid of the trained weights' samples."""
    code = re.search(r"<!-- example: quickstart -->\s*```python\n(.*?)```", (ROOT / "docs/python.md").read_text(),
                     re.S).group(1)
    (tmp_path / "quickstart.py").write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "quickstart.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rewards = re.search(r"reward per iteration: \[(.*)\]", done.stdout).group(1).split(",")
    assert len(rewards) == 3 and all(float(r) < 0 for r in rewards)  # JPEG size in kB, negated
    assert (tmp_path / "runs/quickstart/my_grid.png").stat().st_size > 100
