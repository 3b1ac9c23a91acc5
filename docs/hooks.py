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
        return (ROOT / "CHANGELOG.md").read_text().split("\n", 1)[1]  # without its own title
    if name == "presets":
        return presets_markdown()
    raise ValueError(f"unknown docs marker flowrl:{name}")


def on_page_markdown(markdown: str, page, config, files) -> str:
    return MARKER.sub(lambda m: fill(m.group(1), m.group(2)), markdown)
