"""Files that ship inside the distribution: the embedded models (assets/) and the presets (configs/).

In the repository they are the top-level ``assets/`` and ``configs/`` folders; installed, they are the
package data ``flowrl/assets`` and ``flowrl/configs`` (pyproject maps one to the other), so a plain
``pip install`` works outside the source tree.
"""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent


def _first(*candidates: Path) -> Path:
    return next((c for c in candidates if c.is_dir()), candidates[0])


def assets_dir() -> Path:
    """The installed package data, or the repository's ``assets/`` in a source checkout."""
    return _first(_HERE / "assets", _HERE.parent / "assets")


def configs_dir() -> Path:
    return _first(_HERE / "configs", _HERE.parent / "configs")


def find_config(path: str | Path) -> Path | None:
    """A config path as given if it exists; else the shipped preset of that name (``configs/tiny_default.yaml``,
    ``tiny_default.yaml`` or ``tiny_default``; ``configs/benchmarks/ranked.yaml`` in its subfolder), so
    ``flowrl train configs/tiny_default.yaml`` works from any folder."""
    p = Path(path)
    if p.is_file():
        return p
    name = p.name if p.suffix in (".yaml", ".yml") else p.name + ".yaml"
    inside = p.parts[1:-1] if p.parts[:1] == ("configs",) else p.parts[:-1]  # a subfolder of the presets
    for shipped in (configs_dir().joinpath(*inside, name), configs_dir() / name):
        if shipped.is_file():
            return shipped
    return None
