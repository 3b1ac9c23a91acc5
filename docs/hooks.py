"""mkdocs hooks: fill the generated parts of the pages from the package itself, so they cannot drift from the
code. A page writes a marker comment and the hook replaces it:

- ``<!-- flowrl:config-reference -->``: every configuration key (``flowrl.config.reference_markdown``);
- ``<!-- flowrl:algorithm-options NAME -->``: one algorithm's own keys;
- ``<!-- flowrl:cli-reference -->``: every subcommand and option (``flowrl.cli.cli_reference_markdown``);
- ``<!-- flowrl:changelog -->``: the repository's CHANGELOG.md;
- ``<!-- flowrl:presets -->``: the shipped presets with their first description line;
- ``<!-- flowrl:family-matrix -->``: the model families x features, from each adapter's declarations.
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


def family_matrix_markdown() -> str:
    """One column per built-in model family, each cell read from its adapter class (or counted from the presets)."""
    import yaml

    from flowrl.registry import DEFAULT_FAMILY, MODEL_FAMILIES

    names = [n for n in MODEL_FAMILIES.names() if ":" not in n]
    classes = {n: MODEL_FAMILIES.resolve(n) for n in names}
    presets = {n: 0 for n in names}
    for path in (ROOT / "configs").glob("*.yaml"):
        model = (yaml.safe_load(path.read_text()) or {}).get("model", {})
        if not str(model.get("pretrained", "tiny")).startswith(("tiny", "random")):
            family = model.get("family", DEFAULT_FAMILY)
            presets[family] = presets.get(family, 0) + 1

    def blocks(cls) -> str:
        return ", ".join(f"`{u}`" for u in cls.fsdp_units()) or "no"

    rows = {
        "generates": lambda c: "videos" if c.video else ("image edits (a source image per prompt)" if c.edits
                                                           else "images"),
        "diffusers pipeline (rollout parity and LoRA loading tested against it)": lambda c: f"`{vars(c).get('pipeline_label', c.pipeline_class_name)}`",
        "transformer": lambda c: f"`{c.transformer_class_name}`",
        "LoRA (default targets)": lambda c: f"yes ({len(c.lora_targets)} module names)",
        "full fine-tuning": lambda c: "yes",
        "FSDP2 / HSDP units": blocks,
        "context parallelism": lambda c: ("yes (image and text tokens)" if c.context_parallel_splits_text else "yes")
        if c.context_parallel_plan() else (f"no ({c.context_parallel_refusal})" if c.context_parallel_refusal else
                                           "no (not with source tokens yet)" if c.edits else "no (diffusers has no plan)"),
        "`flowrl memory` without a download": lambda c: "<br>".join(f"`{k}`" for k in c.published_architectures) or "no",
        "shipped full-size presets": None,
    }
    out = ["| | " + " | ".join(f"`{n}`" for n in names) + " |", "|---" * (len(names) + 1) + "|"]
    for label, cell in rows.items():
        values = [str(presets[n]) if cell is None else cell(classes[n]) for n in names]
        out.append(f"| {label} | " + " | ".join(values) + " |")
    return "\n".join(out) + "\n"


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
    if name == "family-matrix":
        return family_matrix_markdown()
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
