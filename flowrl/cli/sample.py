"""A run's weights out: ``flowrl sample`` (grids) and ``export`` (diffusers files)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..editing import check_prompts_fit, prepend_sources
from ..errors import FlowRLError
from ..registry import adapter_class
from .common import ALLOW_PLUGINS_HELP, checkpoint_and_config, parse_seeds


def cmd_sample(args) -> int:
    from ..models import load_adapter
    from ..policy import load_trained_weights
    from ..rundir import check_writable
    from ..report import save_grid, side_by_side
    from ..sampling import Sampler, resolve_device

    ckpt, cfg = checkpoint_and_config(args)
    prompts = args.prompt or cfg.data.sample_prompts or cfg.data.prompts
    if args.source:
        prompts = edit_requests(prompts, args.source)
    elif not args.prompt and getattr(adapter_class(cfg.model.family), "edits", False):
        from ..prompts import PromptSource  # an editing model: the data's first edit requests

        prompts = PromptSource.from_config(cfg.data, cfg.train.seed, cfg.model).prompts[:4]
    if not prompts and cfg.data.prompt_set != "none":
        from ..prompts import prompt_set

        prompts = prompt_set(cfg.data.prompt_set)[:4]
    if not prompts:
        from ..prompts import DEFAULT_TINY_PROMPTS

        prompts = DEFAULT_TINY_PROMPTS[:4]
    check_prompts_fit(cfg.model_copy(update={"data": cfg.data.model_copy(update={"sample_prompts": []})}), prompts)
    seeds = parse_seeds(args.seeds) if args.seeds else cfg.data.sample_seeds
    out = Path(args.out)
    if out.exists() and not args.overwrite:
        raise FlowRLError(f"--out {out} exists; choose another path or pass --overwrite")
    check_writable(out, "--out")
    adapter = load_adapter(cfg.model, resolve_device(cfg.device))
    base = Sampler(cfg, adapter, num_steps=args.steps)(prompts, seeds)
    images, title = base, "base model"
    if ckpt is not None:
        load_trained_weights(adapter, cfg, ckpt)
        tuned = Sampler(cfg, adapter, num_steps=args.steps)(prompts, seeds)
        images = side_by_side(base, tuned, len(seeds))  # each row: base seeds | fine-tuned seeds
        title = f"left {len(seeds)}: base | right {len(seeds)}: {ckpt.parent.parent.name}/{ckpt.name}"
    columns = len(seeds) * (2 if ckpt is not None else 1)  # with a checkpoint: the base's seeds, then the tuned's
    shown = prepend_sources(images, prompts, columns)  # edit requests: each row starts with its source
    if shown is not images:
        columns, title = columns + 1, "source | " + title
    save_grid(shown, columns, out, row_labels=prompts, title=title)
    print(json.dumps({"grid": str(out), "prompts": len(prompts), "seeds": seeds, "columns": columns,
                      "checkpoint": str(ckpt) if ckpt else None}))
    return 0


def edit_requests(prompts: list[str], sources: list[str]) -> list[str]:
    """``--prompt`` instructions with ``--source`` images: one source for every prompt, or one each."""
    from ..editing import EditPrompt, check_source

    if len(sources) not in (1, len(prompts)):
        raise FlowRLError(f"--source: give one source image for every prompt or one per --prompt ({len(prompts)} "
                          f"prompts, {len(sources)} sources)")
    for key in sources:
        check_source(key, "--source")
    return [EditPrompt(p, [sources[0] if len(sources) == 1 else sources[i]]) for i, p in enumerate(prompts)]


def cmd_export(args) -> int:
    """A checkpoint as diffusers files: the LoRA file ``load_lora_weights`` reads, or (full fine-tuning) the
    consolidated transformer folder ``from_pretrained`` reads; sharded checkpoints are gathered into one copy."""
    import shutil

    from ..checkpoint import checkpoint_is_lora, lora_metadata, lora_state_dict
    from ..models import load_adapter
    from ..policy import load_trained_weights
    from ..rundir import check_writable

    args.config, args.overrides = None, []
    ckpt, cfg = checkpoint_and_config(args)
    out = Path(args.out)
    if out.exists():
        raise FlowRLError(f"--out {out} exists; choose a new folder (an export never replaces files)")
    check_writable(out, "--out")
    adapter = load_adapter(cfg.model, "cpu")
    load_trained_weights(adapter, cfg, ckpt)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    transformer = adapter.transformer
    try:
        if checkpoint_is_lora(ckpt):
            adapter.save_lora(tmp, lora_state_dict(transformer), lora_metadata(transformer))
        else:
            transformer.save_pretrained(str(tmp / "transformer"), safe_serialization=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.replace(tmp, out)
    print(json.dumps({"export": str(out), "checkpoint": str(ckpt), "lora": checkpoint_is_lora(ckpt),
                      "files": sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())}))
    return 0


def add_parsers(sub) -> None:
    """This group's subcommands on the ``flowrl`` parser's ``sub``."""
    s = sub.add_parser("sample", help="grid of prompts x seeds from the base model, or base | checkpoint side by side")
    s.add_argument("config", nargs="?")
    s.add_argument("overrides", nargs="*")
    s.add_argument("--checkpoint", help="checkpoint folder or run directory (the weights it ended with: "
                   "checkpoints/best when the run restored them, else its latest; LoRA or full fine-tuning)")
    s.add_argument("--iteration", type=int, help="with a run directory: the checkpoint saved after this iteration")
    s.add_argument("--allow-plugins", action="store_true", help=ALLOW_PLUGINS_HELP)
    s.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    s.add_argument("--prompt", action="append", help="prompt (repeatable); default: the config's sample prompts")
    s.add_argument("--source", action="append", help="an editing model's source image (repeatable: one for every "
                   "--prompt, or one each); default: the data's first edit requests")
    s.add_argument("--seeds", help="comma-separated seeds and ranges: 0,1,2 or 16-31")
    s.add_argument("--steps", type=int, help="ODE steps (default sampler.eval_num_steps)")
    s.add_argument("--out", default="samples.png", help="the grid image (PNG; a video model also writes .gif and .mp4)")
    s.set_defaults(func=cmd_sample)
    x = sub.add_parser("export", help="a run's weights as diffusers files: the LoRA file (load_lora_weights) or the "
                       "full transformer folder (from_pretrained), gathered from a sharded checkpoint")
    x.add_argument("checkpoint", help="run directory (its final weights) or checkpoint folder")
    x.add_argument("--iteration", type=int, help="with a run directory: the checkpoint saved after this iteration")
    x.add_argument("--out", required=True, help="a new folder")
    x.add_argument("--allow-plugins", action="store_true", help=ALLOW_PLUGINS_HELP)
    x.set_defaults(func=cmd_export)
