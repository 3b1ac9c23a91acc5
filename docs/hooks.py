"""mkdocs hooks: fill the generated parts of the pages from the package itself, so they cannot drift from the
code. A page writes a marker comment and the hook replaces it:

- ``<!-- flowrl:config-reference -->``: every configuration key (``flowrl.config.reference_markdown``);
- ``<!-- flowrl:algorithm-options NAME -->``: one algorithm's own keys;
- ``<!-- flowrl:cli-reference -->``: every subcommand and option (``flowrl.cli.cli_reference_markdown``);
- ``<!-- flowrl:changelog -->``: the repository's CHANGELOG.md;
- ``<!-- flowrl:presets -->``: the shipped presets with their first description line.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"<!-- flowrl:([a-z-]+)(?: ([\w.-]+))? -->")


def presets_markdown() -> str:
    rows = ["| preset | what it does |", "|---|---|"]
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        lines = [ln[1:].strip() for ln in path.read_text().splitlines() if ln.startswith("#")]
        what = next((ln for ln in lines if ln and not ln.startswith(("flowrl ", "accelerate ", "make "))), "")
        rows.append(f"| `{path.name}` | {what.replace('|', '/')} |")
    return "\n".join(rows) + "\n"


def fill(name: str, arg: str | None) -> str:
    from flowrl.cli import cli_reference_markdown
    from flowrl.config import reference_markdown

    if name == "config-reference":
        return reference_markdown()
    if name == "algorithm-options":
        return reference_markdown(f"algorithm ({arg})")
    if name == "cli-reference":
        return cli_reference_markdown()
    if name == "changelog":
        text = (ROOT / "CHANGELOG.md").read_text().split("\n", 1)[1]  # without its own title
        return text.replace("](docs/", "](")  # its links are relative to the repository, the page's to docs/
    if name == "presets":
        return presets_markdown()
    raise ValueError(f"unknown docs marker flowrl:{name}")


def installed_layout() -> Path:
    """A folder where ``flowrl`` looks as it does once installed: the repository's top-level ``rewards/`` and
    ``samplers/`` install as ``flowrl.rewards`` and ``flowrl.samplers``, and the API reference reads that layout
    (made of links, rebuilt on every build)."""
    import shutil

    stage = ROOT / "build" / "docs-layout"  # mkdocs.yml's mkdocstrings paths
    shutil.rmtree(stage, ignore_errors=True)
    package = stage / "flowrl"
    package.mkdir(parents=True)
    for entry in (ROOT / "flowrl").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for name in ("rewards", "samplers"):
        (package / name).symlink_to(ROOT / name)
    return stage


installed_layout()  # when mkdocs loads this hook, before mkdocstrings looks for the package


def on_page_markdown(markdown: str, page, config, files) -> str:
    return MARKER.sub(lambda m: fill(m.group(1), m.group(2)), markdown)


# a Sphinx role left in a docstring (``:meth:`~Objective.begin_minibatch```), as mkdocstrings renders it
ROLE = re.compile(r":(?:meth|class|func|attr|data|mod|exc|obj):<code>(~?)([\w.]+)(\(\))?</code>")


def on_page_content(html: str, page, config, files) -> str:
    """The docstrings' Sphinx roles as plain code (``~`` keeps the last name only, as Sphinx shows it)."""
    return ROLE.sub(lambda m: f"<code>{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}"
                              f"{m.group(3) or ''}</code>", html)
