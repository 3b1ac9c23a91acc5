"""What the config says about itself: its JSON Schema, ``flowrl config explain KEY``, a method's defaults,
and the configuration reference page's table."""

from __future__ import annotations

import typing

import yaml
from pydantic import BaseModel

from ..errors import ConfigError
from .base import _choices, _section_type, _type_name, _unknown
from .sections import AlgorithmOptions, Config


def json_schema() -> dict:
    """The JSON Schema of a config file (draft 2020-12), from the models: editors complete and check YAML with it
    (``# yaml-language-server: $schema=flowrl.schema.json``). Each key carries its description, default, range
    and choices; ``algorithm`` is one alternative per registered algorithm, chosen by its ``name``."""
    from ..registry import ALGORITHMS, algorithm_class

    schema = Config.model_json_schema()
    defs = schema.setdefault("$defs", {})
    defs.pop("AlgorithmOptions", None)
    name_doc = AlgorithmOptions.model_fields["name"].description
    alternatives = []
    for name in ALGORITHMS.names():
        alt = algorithm_class(name).Options.model_json_schema()
        defs.update(alt.pop("$defs", {}))
        alt["title"] = name
        alt["properties"]["name"] = {"const": name, "description": name_doc}
        alt["required"] = [] if name == AlgorithmOptions.model_fields["name"].default else ["name"]
        alternatives.append(alt)
    schema["properties"]["algorithm"] = {"description": "the algorithm (name) and its own options",
                                         "oneOf": alternatives}
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


def explain(key: str) -> str:
    """A key's type, default, range or choices and description, for ``flowrl config explain KEY``."""
    from ..registry import ALGORITHMS, algorithm_class

    cls, parts, owner = Config, key.split("."), ""
    for depth, part in enumerate(parts):
        if cls is AlgorithmOptions:  # the options of the algorithms that have this key (the default one first)
            default = AlgorithmOptions.model_fields["name"].default
            names = sorted(ALGORITHMS.names(), key=lambda n: n != default)
            having = [n for n in names if part in algorithm_class(n).Options.model_fields]
            if not having:
                raise ConfigError(f"{key}: no algorithm has the option {part!r} (see `flowrl config schema`)")
            cls = algorithm_class(having[0]).Options
            owner = f" (an option of {', '.join(having)})" if part != "name" else ""
        field = cls.model_fields.get(part) if cls is not None else None
        if field is None:
            raise _unknown(key, Config, "")
        cls = _section_type(field.annotation) if typing.get_origin(field.annotation) is not list else None
        if depth < len(parts) - 1 and cls is None:
            raise _unknown(key, Config, "")
    if cls is not None:
        return f"{key}: a section with keys {', '.join(cls.model_fields)}"
    default = field.get_default(call_default_factory=True)
    if isinstance(default, list):
        default = [d.model_dump() if isinstance(d, BaseModel) else d for d in default]
    lines = [f"{key}{owner}", f"  type: {_type_name(field.annotation)}",
             f"  default: {yaml.safe_dump(default, default_flow_style=True).strip().removesuffix('...').strip()}"]
    choices = _choices(field)
    if choices is not None:
        lines.append(f"  choices: {', '.join(map(str, choices))}")
    bounds = [f"{sign} {getattr(m, attr)}" for m in field.metadata
              for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<=")) if hasattr(m, attr)]
    if bounds:
        lines.append(f"  range: {' and '.join(bounds)}")
    if field.description:
        lines.append(f"  {field.description}")
    by_method = method_defaults(key)
    if by_method:  # what each method uses where a config leaves the key out
        values: dict[str, list[str]] = {}
        for name, v in sorted(by_method.items()):
            values.setdefault(yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip(),
                              []).append(name)
        lines.append("  left out, each method's value (its published choice where the package read one): "
                     + "; ".join(f"{v}: {', '.join(names)}" for v, names in values.items()))
    return "\n".join(lines)


def method_defaults(key: str) -> dict:
    """The value each registered method puts in ``key`` where a config leaves it out (its published choice):
    ``train.cfg_unconditional_grad`` and the ``advantage`` settings a method's released code fixes."""
    from ..registry import ALGORITHMS, algorithm_class

    out = {}
    for name in ALGORITHMS.names():
        cls = algorithm_class(name)
        if key == "train.cfg_unconditional_grad":
            out[name] = bool(getattr(cls, "cfg_unconditional_grad", False))
        elif key.startswith("advantage.") and key.split(".", 1)[1] in getattr(cls, "advantage_defaults", {}):
            out[name] = cls.advantage_defaults[key.split(".", 1)[1]]
    return out


# --------------------------------------------------------------------------------------------- reference
def reference_fields() -> list[tuple[str, str]]:
    """Every leaf key a config file can set, as (table, dotted key): the sections' keys under their section
    (``rewards[].name`` for list entries) and each registered algorithm's own options under ``algorithm
    (<name>)``. The configuration reference prints exactly one row per entry."""
    from ..registry import ALGORITHMS, algorithm_class

    rows: list[tuple[str, str]] = []

    def walk(cls, prefix: str, table: str, nested_table: bool):
        for name, f in cls.model_fields.items():
            sub = _section_type(f.annotation)
            if cls is Config and name == "algorithm":
                continue
            if sub is not None:
                is_list = typing.get_origin(f.annotation) is list
                key = f"{prefix}{name}{'[]' if is_list else ''}"
                walk(sub, key + ".", key.replace("[]", "") if nested_table else table, nested_table)
            else:
                rows.append((table, f"{prefix}{name}"))

    walk(Config, "", "top level", True)
    for name in sorted(ALGORITHMS):  # an algorithm's sub-sections (a window) stay in its one table
        walk(algorithm_class(name).Options, "algorithm.", f"algorithm ({name})", False)
    return rows


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def reference_markdown(only_table: str | None = None) -> str:
    """The configuration reference as Markdown: one table per section (and per algorithm), one row per key with
    its type, default, range or choices and description, read from the schema itself, so it cannot drift.

    Args:
        only_table: one table's name (``train``, ``algorithm (branch_grpo)``); None for all of them.
    Returns:
        Markdown text with a ``###`` heading and a table per section.
    """
    from ..registry import algorithm_class

    tables: dict[str, list[str]] = {}  # a section's keys in one table, even where a sub-section comes between them
    for table, key in reference_fields():
        if only_table is not None and table != only_table:
            continue
        rows = tables.setdefault(table, [])
        owner = Config
        parts = key.replace("[]", "").split(".")  # rewards[].name -> rewards, name
        if table.startswith("algorithm ("):
            owner, parts = algorithm_class(table[len("algorithm ("):-1]).Options, parts[1:]
        for part in parts[:-1]:
            owner = _section_type(owner.model_fields[part].annotation)
        field = owner.model_fields[parts[-1]]
        default = field.get_default(call_default_factory=True)
        if isinstance(default, list):
            default = [d.model_dump() if isinstance(d, BaseModel) else d for d in default]
        default_text = yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("...").strip()
        if table.startswith("algorithm (") and key == "algorithm.name":
            default_text = table[len("algorithm ("):-1]  # the name that selects this table's algorithm
        choices = _choices(field)
        bounds = [f"{sign} {getattr(m, attr)}" for m in field.metadata
                  for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<=")) if hasattr(m, attr)]
        limit = ", ".join(map(str, choices)) if choices is not None else " and ".join(bounds)
        rows.append(f"| `{key}` | {_cell(_type_name(field.annotation))} | `{_cell(default_text)}` | {_cell(limit)} | "
                    f"{_cell(field.description or '')} |")
    out = []
    for table, rows in tables.items():
        if only_table is None:
            out.append(f"\n### `{table}`\n" if table != "top level" else "\n### top level\n")
        out += ["| key | type | default | range or choices | description |", "|---|---|---|---|---|", *rows]
    return "\n".join(out).lstrip("\n") + "\n"
