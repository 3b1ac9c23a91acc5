"""``flowrl pretrain-tiny``: pretrain the embedded tiny text-to-image model on the shapes domain.

A tiny SD3-architecture model (diffusers ``SD3Transformer2DModel`` in pixel space + two tiny CLIP text
encoders trained jointly) learns the rectified-flow objective ``|| v_theta(x_sigma, sigma, c) - (eps - x0) ||^2``
with sigma from SD3's logit-normal density, 10% caption dropout (so CFG works), AdamW and an EMA of the
weights. Resumable; a grid of held-out prompts every ``grid_every`` steps. The exported model (EMA weights,
fp16 safetensors) goes to ``assets/tiny_shapes/`` with the command and wall time beside it.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ..config import TinyModelConfig
from ..resources import assets_dir
from .domain import render, split_specs

SHAPES_TINY = TinyModelConfig(resolution=32, vae=False, patch_size=4, num_layers=4, num_attention_heads=3,
                              attention_head_dim=64, text_hidden=32, text_projection=32, text_layers=2, max_tokens=16,
                              shift=1.0, init_seed=0)
COMPONENTS = ("transformer", "text_encoder", "text_encoder_2")


def shapes_batch(specs, batch: int, rng: random.Random, res: int) -> tuple[torch.Tensor, list[str]]:
    chosen = [specs[rng.randrange(len(specs))] for _ in range(batch)]
    imgs = np.stack([render(s, res, rng.randrange(1 << 30)) for s in chosen])
    x0 = torch.from_numpy(imgs).permute(0, 3, 1, 2).float() / 127.5 - 1.0  # (B, 3, H, W) in [-1, 1]
    return x0, [s.prompt for s in chosen]


def encode(pipe, prompts: list[str]):
    embeds, _, pooled, _ = pipe.encode_prompt(prompt=prompts, prompt_2=prompts, prompt_3=prompts, device="cpu",
                                              do_classifier_free_guidance=False, max_sequence_length=0)
    return embeds, pooled


def _trainable(pipe):
    return [p for name in COMPONENTS for p in getattr(pipe, name).parameters()]


# what an exported tiny model folder may hold: its components, the scheduler, the record and the model card. A
# folder holding anything else is not an earlier export, and is never replaced.
EXPORT_FILES = {"pretrain.json", "MODEL_CARD.md", "model_index.json", "scheduler", "open_clip_config.json",
                "open_clip_model.safetensors", "transformer", "transformer_2", "text_encoder", "text_encoder_2"}
EXPORT_MARKERS = ("pretrain.json", "open_clip_config.json")
STATE_FILES = {"progress.json", "state.pt", *(f"{name}.safetensors" for name in
                                               ("transformer", "transformer_2", "text_encoder", "text_encoder_2"))}


def check_replaceable(path: Path, flag: str, allowed: set[str] = EXPORT_FILES,
                      markers: tuple[str, ...] = EXPORT_MARKERS) -> None:
    """One line unless ``path`` is new, or a folder this command wrote before (it holds one of ``markers`` and
    nothing outside ``allowed``): the only folders a pretraining command replaces. Checked before any work."""
    from ..errors import FlowRLError

    path = Path(path)
    if not path.exists() and not path.is_symlink():
        parent = next((p for p in path.absolute().parents if p.exists()), None)
        if parent is not None and not (parent.is_dir() and os.access(parent, os.W_OK)):
            raise FlowRLError(f"{flag} {path}: cannot create it under {parent}; choose a writable location")
        return
    if path.is_symlink() or not path.is_dir():
        raise FlowRLError(f"{flag} {path}: exists and is not a folder; choose a new folder")
    entries = {p.name for p in path.iterdir()}
    foreign = sorted(entries - allowed)
    if entries and (foreign or not any(m in entries for m in markers)):
        shown = ", ".join(foreign[:3] or sorted(entries)[:3])
        raise FlowRLError(f"{flag} {path}: exists and is not an earlier export of this command (it holds {shown}); "
                          "choose a new folder (flowrl replaces only the folders it wrote)")


def fresh_sibling(path: Path) -> Path:
    """A new, empty folder beside ``path`` to write into before one rename; never a folder that was there."""
    import tempfile

    path.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))


def replace_folder(tmp: Path, path: Path, flag: str, allowed: set[str] = EXPORT_FILES,
                   markers: tuple[str, ...] = EXPORT_MARKERS) -> None:
    """Move the finished ``tmp`` to ``path``, replacing it only if it is still a folder this command wrote."""
    try:
        check_replaceable(path, flag, allowed, markers)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if path.exists():
        old = path.with_name(tmp.name + ".old")
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)


def _save_state(path: Path, pipe, optimizer, ema, step: int, elapsed: float, commands: list[str],
                components: tuple[str, ...] = COMPONENTS) -> None:
    from safetensors.torch import save_model

    tmp = fresh_sibling(path)
    for name in components:
        save_model(getattr(pipe, name), str(tmp / f"{name}.safetensors"))  # tied weights (UMT5's) stored once
    torch.save({"optimizer": optimizer.state_dict(), "ema": ema.state_dict()}, tmp / "state.pt")
    (tmp / "progress.json").write_text(json.dumps({"step": step, "elapsed_s": elapsed, "commands": commands}))
    replace_folder(tmp, path, "--work-dir", STATE_FILES, ("progress.json",))


def _load_state(path: Path, pipe, optimizer, ema, components: tuple[str, ...] = COMPONENTS) -> tuple[int, float, list[str]]:
    from safetensors.torch import load_model

    for name in components:
        load_model(getattr(pipe, name), str(path / f"{name}.safetensors"))
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    ema.load_state_dict(state["ema"])
    prog = json.loads((path / "progress.json").read_text())
    return int(prog["step"]), float(prog["elapsed_s"]), list(prog.get("commands", []))


def export_model(pipe, out_dir: Path, meta: dict, components: tuple[str, ...] = COMPONENTS,
                 keep: tuple[str, ...] = ("MODEL_CARD.md",)) -> Path:
    """Write the trained components as fp16 safetensors + configs (tokenizers are rebuilt offline); files named in
    ``keep`` (the model card) carry over from the folder being replaced."""
    tmp = fresh_sibling(out_dir)
    for name in keep:
        if (out_dir / name).is_file():
            shutil.copy2(out_dir / name, tmp / name)
    for name in components:
        module = getattr(pipe, name)
        module.to(torch.float16).save_pretrained(str(tmp / name), safe_serialization=True)
        module.to(torch.float32)
    pipe.scheduler.save_pretrained(str(tmp / "scheduler"))
    if pipe.config.get("boundary_ratio") is not None:  # a two-expert (Wan 2.2) pipeline: its boundary with it
        (tmp / "model_index.json").write_text(json.dumps({"boundary_ratio": pipe.config["boundary_ratio"]}))
    (tmp / "pretrain.json").write_text(json.dumps(meta, indent=1))
    replace_folder(tmp, out_dir, "--export-dir")
    return out_dir


def invoked_command(subcommand: str, function: str) -> str:
    """The command line that is running this pretraining (``flowrl <subcommand> ...``), or the Python call's name:
    what the exported ``pretrain.json`` records."""
    if sys.argv[1:2] == [subcommand]:
        return (f"flowrl {subcommand} " + " ".join(sys.argv[2:])).strip()
    return f"{function}()"


def start_or_resume(work_dir: Path, pipe, optimizer, ema, components: tuple[str, ...], subcommand: str,
                    function: str, seed: int):
    """The run's state: resumed from ``<work_dir>/state`` when a save is there, else a fresh start; this invocation's
    command appended to the run's command list; the data RNG and the noise generator seeded from (seed, step), so
    a resumed run draws the same way wherever it resumed.

    Returns:
        ``(step, elapsed seconds, commands, rng, generator)``.
    """
    step, elapsed, commands = 0, 0.0, []
    state_dir = work_dir / "state"
    check_replaceable(state_dir, "--work-dir", STATE_FILES, ("progress.json",))
    if (state_dir / "progress.json").is_file():
        step, elapsed, commands = _load_state(state_dir, pipe, optimizer, ema, components)
        print(f"resuming {subcommand} at step {step} ({elapsed / 60:.1f} min so far)", file=sys.stderr)
    work_dir.mkdir(parents=True, exist_ok=True)
    commands = commands + [f"{invoked_command(subcommand, function)}  # from step {step}"]
    return (step, elapsed, commands, random.Random(seed * 100003 + step),
            torch.Generator().manual_seed(seed * 100003 + step))


def log_progress(work_dir: Path, record: dict, bar) -> None:
    """One held-out readout: a line of ``<work_dir>/progress.jsonl`` and of the progress bar's output."""
    with open(work_dir / "progress.jsonl", "a") as fh:
        fh.write(json.dumps(record) + "\n")
    bar.write(json.dumps(record))


def noised(x0: torch.Tensor, sigma: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_sigma = (1 - sigma) x0 + sigma eps, the rectified-flow target eps - x0) for x0 (B, ...) and sigma (B,)."""
    eps = torch.randn(x0.shape, generator=gen)
    s = sigma.view(-1, *([1] * (x0.ndim - 1)))
    return (1 - s) * x0 + s * eps, eps - x0


def optimizer_step(loss: torch.Tensor, optimizer, params, ema, lr: float) -> None:
    """Backward, clip the gradient norm at 1, one AdamW step at ``lr``, one EMA step."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    for g in optimizer.param_groups:
        g["lr"] = lr
    optimizer.step()
    ema.step(params)


def lr_factor(step: int, steps: int, decay_from: int | None, lr_final: float) -> float:
    """Linear warm-up over 200 steps, then constant; from `decay_from` a cosine down to `lr_final` x lr at `steps`.

    The decay start is a step number rather than "the resumed step", so a run resumed anywhere follows the
    same schedule as one that ran straight through.
    """
    factor = min(1.0, (step + 1) / 200)
    if decay_from is not None and step >= decay_from and steps > decay_from:
        progress = min(1.0, (step - decay_from) / (steps - decay_from))
        factor *= lr_final + (1 - lr_final) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


@contextmanager
def sampling_ema_weights(pipe, params, ema):
    """The EMA weights in place and an adapter that samples them; afterwards the trained weights are back and every
    component trains again (the adapter freezes the text encoders and puts them in eval mode, which without this
    would stop their training at the first grid)."""
    from ..models.sd3 import SD3Adapter

    ema.store(params)
    ema.copy_to(params)
    try:
        yield SD3Adapter(pipe, max_sequence_length=0)
    finally:
        ema.restore(params)
        for name in COMPONENTS:
            getattr(pipe, name).train().requires_grad_(True)


def _sample_heldout(adapter, prompts: list[str], seeds, steps: int = 10, guidance_scale: float = 4.5) -> torch.Tensor:
    """(P * S, 3, H, W) ODE samples with CFG, prompt-major."""
    from ..samplers import make_sigmas
    from ..sampling import sample_images

    sigmas = make_sigmas("diffusers", steps, scheduler_config=dict(adapter.pipe.scheduler.config))
    res = SHAPES_TINY.resolution
    return sample_images(adapter, prompts, list(seeds), sigmas, (3, res, res), guidance_scale,
                         adapter.encode_prompts([""]))


def heldout_readout(adapter, seeds=(0, 1, 2, 3)) -> dict:
    """Held-out accuracy of the adapter's weights (every held-out caption x ``seeds``, 10 ODE steps, CFG 4.5)."""
    from .evaluate import shapes_accuracy

    return shapes_accuracy(lambda prompts, s: _sample_heldout(adapter, prompts, s), list(seeds))


def _warm_start(pipe, source: Path) -> dict:
    """Every component of an exported tiny shapes model (``flowrl pretrain-tiny`` output) into ``pipe``; returns the
    source's ``pretrain.json`` so the new export records its lineage."""
    from ..errors import FlowRLError
    from .image_model import load_tiny_shapes_pipeline

    config = source / "transformer" / "config.json"
    kind = json.loads(config.read_text()).get("_class_name") if config.is_file() else None
    if kind != "SD3Transformer2DModel":
        raise FlowRLError(f"--init-from {source}: not an exported tiny shapes model (its transformer is {kind}); "
                          "give a folder written by `flowrl pretrain-tiny`, such as assets/tiny_shapes")
    exported = load_tiny_shapes_pipeline(source)
    for name in COMPONENTS:
        try:
            getattr(pipe, name).load_state_dict(getattr(exported, name).state_dict())
        except RuntimeError:  # missing, unexpected or differently shaped weights
            raise FlowRLError(f"--init-from {source}: its {name} has another architecture than the tiny shapes "
                              "model's (flowrl.shapes.pretrain.SHAPES_TINY); start from a model it wrote") from None
    meta = source / "pretrain.json"
    return json.loads(meta.read_text()) if meta.is_file() else {}


def pretrain_tiny(work_dir: str | Path = "runs/pretrain-tiny", steps: int = 4000, batch: int = 32, lr: float = 1e-3,
                  seed: int = 0, ema_decay: float = 0.999, caption_dropout: float = 0.1, save_every: int = 250,
                  grid_every: int = 500, export_dir: str | Path | None = None, progress: bool = True,
                  decay_from: int | None = None, lr_final: float = 0.1, init_from: str | Path | None = None,
                  eval_every: int = 0) -> Path:
    """Pretrain (or, with ``init_from``, continue pretraining an exported model: its weights start both the trained
    copy and the EMA, with a fresh optimizer and warm-up) and export. ``eval_every`` > 0 reads the held-out accuracy
    of the EMA weights (24 captions x 4 seeds) into ``progress.jsonl`` every that many steps."""
    from diffusers.training_utils import EMAModel

    from ..models.tiny import build_tiny_sd3_pipeline
    from ..report import save_grid

    work_dir = Path(work_dir)
    out = Path(export_dir) if export_dir else assets_dir() / "tiny_shapes"
    check_replaceable(out, "--export-dir")  # before any work: an export never replaces a folder it did not write
    torch.manual_seed(seed)
    pipe = build_tiny_sd3_pipeline(SHAPES_TINY, seed=seed)
    parent = _warm_start(pipe, Path(init_from)) if init_from is not None else None  # before the EMA copies them
    params = _trainable(pipe)
    for name in COMPONENTS:
        getattr(pipe, name).train().requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
    ema = EMAModel(params, decay=ema_decay)
    train_specs, held_specs = split_specs()
    step, elapsed, commands, rng, gen = start_or_resume(work_dir, pipe, optimizer, ema, COMPONENTS, "pretrain-tiny",
                                                        "pretrain_tiny", seed)
    command = invoked_command("pretrain-tiny", "pretrain_tiny")
    n_params = sum(p.numel() for p in pipe.transformer.parameters())
    n_text = sum(p.numel() for n in COMPONENTS[1:] for p in getattr(pipe, n).parameters())
    bar = tqdm(total=steps, initial=step, desc="pretrain", disable=not progress)
    loss_ema, readout = None, None
    t_start = time.perf_counter() - elapsed
    while step < steps:
        x0, prompts = shapes_batch(train_specs, batch, rng, SHAPES_TINY.resolution)
        prompts = ["" if rng.random() < caption_dropout else p for p in prompts]
        embeds, pooled = encode(pipe, prompts)
        sigma = torch.sigmoid(torch.randn(batch, generator=gen))  # SD3 logit-normal(0, 1)
        x, target = noised(x0, sigma, gen)
        v = pipe.transformer(hidden_states=x, timestep=sigma * 1000, encoder_hidden_states=embeds,
                             pooled_projections=pooled, return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(v, target)
        optimizer_step(loss, optimizer, params, ema, lr * lr_factor(step, steps, decay_from, lr_final))
        step += 1
        loss_ema = float(loss) if loss_ema is None else 0.98 * loss_ema + 0.02 * float(loss)
        bar.update(1)
        bar.set_postfix(loss=f"{loss_ema:.4f}")
        if step % save_every == 0 or step == steps:
            _save_state(work_dir / "state", pipe, optimizer, ema, step, time.perf_counter() - t_start, commands)
        grid_now = step % grid_every == 0 or step == steps
        eval_now = eval_every > 0 and (step % eval_every == 0 or step == steps)
        if grid_now or eval_now:
            with sampling_ema_weights(pipe, params, ema) as adapter:
                if grid_now:
                    prompts_h = [s.prompt for s in held_specs[:: max(1, len(held_specs) // 6)][:6]]
                    save_grid(_sample_heldout(adapter, prompts_h, [0, 1, 2, 3]), 4,
                              work_dir / "grids" / f"step_{step:06d}.png", row_labels=prompts_h,
                              title=f"pretraining step {step}, held-out prompts, EMA, CFG 4.5")
                if eval_now:
                    readout = heldout_readout(adapter)
            if eval_now:
                record = {"step": step, "minutes": round((time.perf_counter() - t_start) / 60, 1), "loss": loss_ema,
                          **{k: readout[k] for k in ("background", "color", "shape", "all", "per_shape")}}
                log_progress(work_dir, record, bar)
    bar.close()
    steps = max(steps, step)  # --steps below the saved step exports the current state as it is
    wall = time.perf_counter() - t_start
    ema.copy_to(params)
    meta = {"command": command, "commands": commands,
            "steps": steps, "batch": batch, "lr": lr, "decay_from": decay_from, "lr_final": lr_final, "seed": seed, "ema_decay": ema_decay,
            "caption_dropout": caption_dropout, "wall_time_s": round(wall, 1), "final_loss_ema": loss_ema,
            "transformer_params": n_params, "text_encoder_params": n_text, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "config": SHAPES_TINY.__dict__, "heldout_readout": readout}
    if init_from is not None:  # the steps above continue the parent's: its settings and time travel with the export
        meta.update({"init_from": str(init_from), "parent": parent})
    export_model(pipe, out, meta)
    print(json.dumps({"exported": str(out), "wall_time_min": round(wall / 60, 1), "loss": loss_ema}))
    return out
