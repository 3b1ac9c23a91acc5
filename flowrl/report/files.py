"""Run-folder files: atomic writes, CSV, and metrics rows (JSON lines) that survive a crash."""

from __future__ import annotations

import csv
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

RUN_LOCK = ".lock"  # a run folder's lock file: one writer at a time (flowrl.rundir.RunFolder.lock)


def run_being_written(folder: Path) -> bool:
    """Whether a live process holds ``folder``'s run lock (an exclusive ``flock``; it ends with its process, so a
    crashed writer's folder is not held)."""
    import fcntl

    path = Path(folder) / RUN_LOCK
    if not path.is_file():
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # closing the descriptor releases a lock this probe took
    return False


@contextmanager
def atomic_path(path: Path):
    """A temporary name beside ``path`` to write to (a file or a folder); renamed to ``path`` when the block ends
    normally, removed when it raises (a full disk, an interrupt): the destination is whole or untouched, and
    nothing is left behind."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_csv(path: Path, rows: list[dict], fieldnames: list[str] | None = None) -> None:
    """CSV written whole and renamed into place, so an interrupted run leaves no half-written file."""
    import io

    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=fieldnames or (list(rows[0]) if rows else []))
    writer.writeheader()
    writer.writerows(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, buf.getvalue().encode("utf-8"))


def finite_json(obj):
    """``obj`` with every NaN or infinite number replaced by None (strict JSON parsers refuse NaN)."""
    import math

    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


def number(value) -> float:
    """A number read back from JSON: null (a non-finite number written by :func:`finite_json`) is NaN."""
    return float("nan") if value is None else value


def append_metrics(path: Path, row: dict) -> None:
    """One row, flushed to disk before returning (a crash loses at most the row being written)."""
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(row, sort_keys=False) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def read_metrics(path: Path, warn: bool = True) -> list[dict]:
    """Every readable row; a damaged line (cut by a crash, edited by hand) is skipped and named on stderr,
    and the rows after it are kept."""
    import sys

    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if isinstance(row, dict):
                rows.append(row)
            elif warn:
                print(f"flowrl: warning: {path}:{n} is not a metrics row; skipped", file=sys.stderr)
    return rows


def truncate_metrics(path: Path, before_iteration: int) -> list[dict]:
    """Keep only rows of iterations < ``before_iteration`` (used on resume); returns the rows removed."""
    if not Path(path).is_file():
        return []
    rows = read_metrics(path)
    keep = [r for r in rows if r.get("iteration", 0) < before_iteration]
    atomic_write_bytes(Path(path), "".join(json.dumps(r) + "\n" for r in keep).encode())
    return [r for r in rows if r.get("iteration", 0) >= before_iteration]


def save_figure(fig, path: Path) -> None:
    """A matplotlib figure written to a temporary name and renamed into place, then closed."""
    import matplotlib.pyplot as plt

    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=110, bbox_inches="tight")
    finally:
        plt.close(fig)
