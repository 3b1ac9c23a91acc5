"""What several commands share: loading a config, a run's checkpoint and config, the evaluator, seeds."""

from __future__ import annotations

from pathlib import Path

from ..errors import FlowRLError
from ..report.files import finite_json  # noqa: F401 (the CLI's helper, kept here for its callers)

DEFAULT_PRESET = "tiny_shapes_flow_grpo.yaml"  # what `flowrl eval` evaluates with no config: the shipped model


def load_cli_config(config: str | None, overrides: list[str]):
    from ..config import load_config

    return load_config(config, overrides)


def parse_seeds(text: str, flag: str = "--seeds") -> list[int]:
    """``0,1,2`` -> [0, 1, 2]; ``16-31`` -> 16, 17, ..., 31 (ranges and single seeds may mix: ``0,4-6``); anything
    else is one line naming the part that is not a seed or a range."""
    seeds = []
    for part in (p.strip() for p in text.split(",")):
        first, dash, last = part.partition("-")
        if part.isdigit():
            seeds.append(int(part))
        elif dash and first.isdigit() and last.isdigit() and int(first) <= int(last):
            if int(last) - int(first) >= 100_000:
                raise FlowRLError(f"{flag} {text}: the range {part} holds over 100,000 seeds; give a shorter one")
            seeds += range(int(first), int(last) + 1)
        else:
            raise FlowRLError(f"{flag} {text}: {part!r} is neither a seed nor a range; give seeds such as 0,1,2,3 or "
                              "16-31")
    from ..config import check_seeds

    check_seeds(seeds, flag)
    return seeds


def checkpoint_and_config(args, default_config: Path | None = None):
    """(checkpoint folder or None, config): a run directory means the weights it ended with (checkpoints/best when
    log.keep_best restored them, else its latest checkpoint; or the one after ``--iteration``), and the run's own
    config.yaml is used unless a config is given."""
    from ..checkpoint import find_checkpoint
    from ..config import load_config

    if not args.checkpoint:
        if getattr(args, "iteration", None) is not None:
            raise FlowRLError("--iteration needs --checkpoint RUN_DIR")
        return None, load_config(args.config or default_config, args.overrides)
    ckpt = find_checkpoint(args.checkpoint, getattr(args, "iteration", None))
    return ckpt, load_run_config(args, ckpt)


ALLOW_PLUGINS_HELP = ("import the module:attribute plug-ins a run's saved config names (its rewards, evaluator, "
                      "family...); without it they are refused, since reading a run someone sent you must not run "
                      "its code")


def load_run_config(args, ckpt: Path):
    """The config for a checkpoint: the user's CONFIG when given, else the run's own ``config.yaml``, whose
    ``module:attribute`` names are not imported for the rest of this command unless the user typed them too or
    passed ``--allow-plugins`` (see :func:`flowrl.registry.names_come_from`)."""
    from ..config import load_config
    from ..registry import names_come_from

    if args.config:
        return load_config(args.config, args.overrides)
    saved = Path(ckpt).parent.parent / "config.yaml"
    names_come_from(saved, typed_words(args), getattr(args, "allow_plugins", False))
    return load_config(saved, args.overrides)


def typed_words(args) -> list[str]:
    """Every word the user gave this command (option values and overrides)."""
    words = []
    for value in vars(args).values():
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, str):
                words.append(item)
    return words


def config_evaluator(cfg):
    """The config's held-out evaluator (log.eval), or one line saying to choose one."""
    from ..registry import EVALUATORS

    if cfg.log.eval == "none":
        raise FlowRLError("flowrl eval: the config has no held-out evaluator; give a config with log.eval set, or "
                          "--prompts / --reward for a reward table")
    return EVALUATORS.resolve(cfg.log.eval)()


def split_name(split: str, cfg) -> str:
    """--split heldout / train -> the prompt set the config's evaluator names for it (or a prompt set by name)."""
    return getattr(config_evaluator(cfg), "splits", {}).get(split, split) if cfg.log.eval != "none" else split


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
