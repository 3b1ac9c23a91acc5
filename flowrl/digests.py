"""File digests of a checkpoint: SHA-256 of every file, recorded when it is saved (``digests.json``) and checked
before any of its weights is used, so a file cut short, deleted or with a flipped byte is named and refused (and
``resume=latest`` falls back to the newest intact checkpoint) instead of loading damaged numbers."""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

DIGESTS = "digests.json"
_CHUNK = 8 << 20


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)  # hashlib releases the GIL on large updates: files hash in parallel threads
    return h.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in Path(folder).rglob("*") if p.is_file() and p.name != DIGESTS)


def write_digests(folder: Path) -> None:
    """Record the digest of every file under ``folder`` (a checkpoint being written, before it takes its name)."""
    files = _files(folder)
    with ThreadPoolExecutor(max_workers=8) as pool:
        sums = list(pool.map(sha256, files))
    record = {str(f.relative_to(folder)): s for f, s in zip(files, sums)}
    (Path(folder) / DIGESTS).write_text(json.dumps(record, indent=1, sort_keys=True))


def digest_problem(folder: Path) -> str | None:
    """None when every file recorded in ``digests.json`` is present with its digest (or the checkpoint predates
    digests), else which file differs."""
    path = Path(folder) / DIGESTS
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        assert isinstance(record, dict) and all(isinstance(v, str) for v in record.values())
    except (OSError, ValueError, AssertionError):
        return f"{DIGESTS} is unreadable"
    outside = next((name for name in record if Path(name).is_absolute() or ".." in Path(name).parts
                    or not name or "\\" in name), None)
    if outside is not None:
        return f"{DIGESTS} names {outside!r}, which is not a file inside the checkpoint"
    files = [Path(folder) / name for name in record]
    missing = [f for f in files if not f.is_file()]
    if missing:
        return f"{missing[0].relative_to(folder)} is missing"
    with ThreadPoolExecutor(max_workers=8) as pool:
        sums = list(pool.map(sha256, files))
    for (name, expected), actual in zip(record.items(), sums):
        if actual != expected:
            return f"{name} differs from the file saved (its SHA-256 does not match digests.json)"
    return None


def recorded(folder: Path) -> set[str]:
    """The file names (relative to ``folder``) that ``digests.json`` covers; empty when it is absent or unreadable."""
    try:
        record = json.loads((Path(folder) / DIGESTS).read_text())
    except (OSError, ValueError):
        return set()
    return set(record) if isinstance(record, dict) else set()
