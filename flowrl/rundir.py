"""A run's folder, owned by one run: a new run never reuses a folder that holds another run's metrics or
checkpoints, nor a folder flowrl did not make (a run folder carries the marker file ``.flowrl-run``), a resume
moves what it abandons aside instead of deleting or mixing it, and every location is checked writable before a
model is loaded."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from . import report
from .checkpoint import checkpoints_newest_first
from .config import save_config
from .errors import ConfigError
from .report.files import RUN_LOCK

ABANDONED = "abandoned"
MARKER = ".flowrl-run"  # written into every run folder when it opens: the folder is a run's, made by flowrl
LOCK = RUN_LOCK  # the run folder's lock file: one writer at a time (RunFolder.lock)
_HELD_LOCKS: dict[Path, list] = {}  # lock file -> [descriptor, holders in this process]


def check_writable(path: Path, key: str) -> None:
    """``path`` (a folder to create or a file to write) can be written: its nearest existing ancestor is a
    writable folder. Raises one line naming the config key or option."""
    probe = Path(path).resolve()
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"{key}: {probe} is a file, not a folder; choose another location")
    try:  # a real write: permissions, read-only mounts and special file systems all show here (root included)
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as exc:
        raise ConfigError(f"{key}: cannot write in {probe} ({exc.strerror or exc}); choose a writable location") from exc


class RunFolder:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.metrics = self.path / "metrics.jsonl"
        self.curve = self.path / "eval_curve.jsonl"  # curve rows count iterations done (0 = before)

    @classmethod
    def plan(cls, cfg, config_name: str, run_dir=None, resume_ckpt: Path | None = None) -> "RunFolder":
        """Where the run goes, checked before any work: not another run's folder (unless resuming it), writable."""
        if resume_ckpt is not None:
            path = resume_ckpt.parent.parent
        elif run_dir is not None:
            path = Path(run_dir)
        else:
            path = Path(cfg.log.output_dir) / (cfg.log.run_name or f"{config_name}-{time.strftime('%Y%m%d-%H%M%S')}")
        folder = cls(path)
        if resume_ckpt is None and folder.holds_run():
            raise ConfigError(f"log.run_name: {path} already holds a run ({folder.describe()}); continue it with "
                              f"resume=latest log.run_name={path.name}, or choose another log.run_name")
        if resume_ckpt is None and folder.foreign():
            entries = sum(1 for _ in path.iterdir())
            raise ConfigError(f"log.run_name: {path} already exists and holds {entries} entries that no flowrl run "
                              "wrote; choose another log.run_name (nothing in that folder was touched)")
        check_writable(path, "log.output_dir")
        return folder

    def lock(self) -> None:
        """One writer per run folder: an exclusive lock on the folder's ``.lock`` file (holding the writer's pid),
        held until :meth:`unlock` or the process ends; a second process's ``train`` into the same run is refused in
        one line before it writes anything. Within one process a later trainer of the same run (a resume in a
        notebook, say) shares the lock the process holds."""
        import fcntl

        self.path.mkdir(parents=True, exist_ok=True)
        lock_path = (self.path / LOCK).resolve()
        held = _HELD_LOCKS.get(lock_path)
        if held is not None:  # this process already writes the run: the same lock, counted once more
            held[1] += 1
            self._lock_path = lock_path
            return
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            other = os.read(fd, 32).decode(errors="replace").strip()
            os.close(fd)
            who = f" (pid {other})" if other.isdigit() else ""
            raise ConfigError(f"log.run_name: another flowrl train{who} is writing to {self.path}; wait for it to "
                              "end or choose another log.run_name") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        _HELD_LOCKS[lock_path] = [fd, 1]
        self._lock_path = lock_path

    def unlock(self) -> None:
        lock_path, self._lock_path = getattr(self, "_lock_path", None), None
        held = _HELD_LOCKS.get(lock_path) if lock_path is not None else None
        if held is not None:
            held[1] -= 1
            if held[1] == 0:
                del _HELD_LOCKS[lock_path]
                os.close(held[0])  # closing the descriptor releases the lock

    def __del__(self):
        self.unlock()

    def checkpoints(self) -> list[Path]:
        return checkpoints_newest_first(self.path)[::-1]  # oldest first

    def foreign(self) -> bool:
        """The folder exists, is not empty and was not made by flowrl (it has no :data:`MARKER`)."""
        return self.path.is_dir() and not (self.path / MARKER).is_file() and any(
            p.name != LOCK for p in self.path.iterdir())

    def holds_run(self) -> bool:
        return bool(report.read_metrics(self.metrics, warn=False)) or bool(self.checkpoints())

    def describe(self) -> str:
        rows, ckpts = report.read_metrics(self.metrics, warn=False), self.checkpoints()
        last = f", checkpoints up to {ckpts[-1].name}" if ckpts else ""
        return f"{len(rows)} iterations logged{last}"

    def open(self, cfg, resume_from: int | None, trackers) -> None:
        """Create the folder and write the resolved config. Resuming at iteration ``resume_from``: later
        checkpoints and metrics rows belong to an abandoned continuation and are moved to ``abandoned-<time>``."""
        self.path.mkdir(parents=True, exist_ok=True)
        if not (self.path / MARKER).is_file():
            report.atomic_write_bytes(self.path / MARKER, json.dumps({"flowrl_run": True}).encode())
        if resume_from is None:
            self.metrics.unlink(missing_ok=True)  # holds no rows (plan() checked); a run starts it fresh
            self.curve.unlink(missing_ok=True)
        else:
            self._abandon_after(resume_from)
        with report.atomic_path(self.path / "config.yaml") as tmp:
            save_config(cfg, tmp)
        if trackers:
            trackers.init_trackers(self.path.name)

    def _abandon_after(self, start: int) -> None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        moved = []
        later = [p for p in self.checkpoints() if int(p.name[5:]) >= start]
        if later:
            dest = self.path / "checkpoints" / f"{ABANDONED}-{stamp}"
            dest.mkdir(parents=True, exist_ok=True)
            for p in later:
                shutil.move(str(p), dest / p.name)
            moved.append(f"{len(later)} later checkpoint(s) to {dest}")
        for path, first_dropped in ((self.metrics, start), (self.curve, start + 1)):
            dropped = report.truncate_metrics(path, first_dropped)
            if dropped:
                keep = path.with_name(f"{path.stem}.{ABANDONED}-{stamp}.jsonl")
                report.atomic_write_bytes(keep, "".join(json.dumps(r) + "\n" for r in dropped).encode())
                moved.append(f"{len(dropped)} later row(s) of {path.name} to {keep.name}")
        if moved:
            print(f"flowrl: resuming at iteration {start}; moved aside what came after it: {'; '.join(moved)}",
                  file=sys.stderr)
