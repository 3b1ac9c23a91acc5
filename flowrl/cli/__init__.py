"""The ``flowrl`` command line, one module per command group: train (train, memory, presets, config), sample
(sample, export), evaluate (eval), runs (compare, rank), bench (bench, bench-gpu, gpu-check) and serve
(serve-reward); what they share is in common. Plug-ins add commands through ``flowrl.registry.COMMANDS``."""

from __future__ import annotations

import argparse
import contextvars
import os
import sys

from ..cli_types import Parser
from ..errors import ConfigError, FlowRLError
from ..registry import COMMANDS
from . import bench, credit, evaluate, runs, sample, serve, train
from .common import finite_json, parse_seeds, torch_cuda_available  # noqa: F401 (the package's helpers, re-exported)

# the subcommands in the order --help lists them; each group adds its own
GROUPS = (train, sample, runs, credit, bench, evaluate, serve)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="flowrl", description="GRPO fine-tuning of flow-matching models.")
    sub = p.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        group.add_parsers(sub)
    for name in COMMANDS.names():  # commands that plug-ins register or install (the tiny demo's pretraining among them)
        try:
            COMMANDS.resolve(name)(sub)
        except Exception as exc:  # one broken plug-in leaves every other command working
            print(f"flowrl: warning: the plug-in commands {name!r} are left out: {str(exc)[:200]}", file=sys.stderr)
    for sp in sub.choices.values():  # the positional arguments every config-taking command shares
        for action in sp._actions:
            if action.help is None and action.dest in _SHARED_HELP:
                action.help = _SHARED_HELP[action.dest]
    return p


_SHARED_HELP = {"config": "YAML config, or a shipped preset's file name (`flowrl presets`)",
                "overrides": "key.sub=value overrides applied after the file (`flowrl config explain KEY`)"}


def cli_reference_markdown() -> str:
    """Every subcommand with its purpose, usage line and options, as Markdown, read from the parser itself.

    Returns:
        Markdown with one ``###`` heading per subcommand (including those plug-ins register).
    """
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in sub._choices_actions}
    out = []
    for name, sp in sub.choices.items():
        usage = " ".join(sp.format_usage().split())[len("usage: "):]
        out += [f"### `flowrl {name}`", "", (helps.get(name) or "").rstrip(".") + ".", "", "```text", usage, "```", ""]
        rows = []
        for action in sp._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            names = ", ".join(action.option_strings) or action.dest
            default = "" if action.default in (None, argparse.SUPPRESS, False) or not action.option_strings \
                else f"`{action.default}`"
            choices = ", ".join(map(str, action.choices)) if action.choices else ""
            text = (action.help or "").replace("|", "\\|")
            rows.append(f"| `{names}` | {default} | {choices} | {text} |")
        if rows:
            out += ["| argument | default | choices | meaning |", "|---|---|---|---|", *rows, ""]
        if sp.epilog:
            out += [sp.epilog, ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, or a bad argument already reported in one line
        return exc.code if isinstance(exc.code, int) else 2
    # a config path that looks like an override belongs to the overrides
    if getattr(args, "config", None) and "=" in args.config and not os.path.exists(args.config):
        args.overrides = [args.config] + list(args.overrides)
        args.config = None
    try:
        # each call in its own context: what one command learns of its inputs (names from a saved run's config that
        # must not be imported) does not outlive it
        return contextvars.copy_context().run(args.func, args)
    except FlowRLError as exc:
        kind = "stopped" if getattr(exc, "exit_code", 2) != 2 else "error"
        launched_rank = int(os.environ.get("RANK", "0") or 0) if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 else 0
        if not (isinstance(exc, ConfigError) and launched_rank):  # every process refuses alike: the main one says so
            print(f"flowrl: {kind}: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 2)
    except KeyboardInterrupt:
        print("flowrl: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:  # a disk that fills up or a folder that disappears mid-run: one line, not a traceback
        where = f" {exc.filename}" if exc.filename else ""
        print(f"flowrl: error: cannot write or read{where}: {exc.strerror or exc}; free space or choose another "
              "location (files written before this are complete: flowrl writes to a temporary name, then renames)",
              file=sys.stderr)
        return 2
