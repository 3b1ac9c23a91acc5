"""A wheel built from the repository, installed into a fresh environment, works from a folder outside the
repository: the shipped model (package data), the default CLIP reward's assets and the presets by path."""

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy  # processes launched in subprocesses: `make test-heavy`

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_installs_and_runs_outside_the_repository(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
                    str(ROOT)], check=True, cwd=tmp_path)
    (wheel,) = dist.glob("flowrl_tree-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "flowrl/assets/tiny_shapes/transformer/diffusion_pytorch_model.safetensors" in names
    assert "flowrl/assets/tiny_clip/open_clip_model.safetensors" in names
    assert "flowrl/configs/tiny_default.yaml" in names and "flowrl/samplers/kernels.py" in names
    assert "flowrl/configs/benchmarks/ranked.yaml" in names  # the ranked table's plan, by its documented path
    # a fresh environment; the pinned torch and the other dependencies are reused from this one (a .pth line
    # adds its site-packages to the path without running its .pth files, so the editable flowrl stays out)
    env_dir = tmp_path / "env"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", str(env_dir)], check=True)
    py = env_dir / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "reuse_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
    where = subprocess.run([str(py), "-c", "import flowrl; print(flowrl.__file__)"], cwd=work, env=env, check=True,
                           capture_output=True, text=True).stdout.strip()
    assert where.startswith(site), where
    flowrl = str(env_dir / "bin" / "flowrl")
    out = subprocess.run([flowrl, "eval", "--seeds", "0"], cwd=work, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["images"] == 24 and result["background"] >= 0.9
    out = subprocess.run([flowrl, "train", "configs/tiny_default.yaml", "train.iterations=2", "log.eval=none",
                          "log.progress=false", "rewards[1].name=clip", "log.run_name=w", "train.prompts_per_iter=2"],
                         cwd=work, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["iterations"] == 2 and (work / "runs" / "w" / "checkpoints").is_dir()
