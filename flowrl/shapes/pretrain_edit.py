"""``flowrl pretrain-tiny-edit``: pretrain the embedded tiny image-editing model on shapes edit pairs.

A pixel-space FLUX.1 Kontext-architecture model (diffusers ``FluxTransformer2DModel`` in ``FluxKontextPipeline``'s
layout: the source image's 2x2-packed pixels appended after the noisy image's tokens, with position ids whose first
coordinate is 1) and its two tiny text encoders (CLIP and T5) learn the rectified-flow objective
``|| v_theta(x_sigma, sigma, instruction, source) - (eps - x0) ||^2`` on procedurally generated edit pairs: a source
from a training caption, an instruction that changes one attribute ("make the shape red", "make the background
blue", "turn the circle into a square") and the target, the source re-rendered with that attribute changed at the
same size and position (or, with ``missed`` / ``over_edited``, an imperfect dataset's target: the source unchanged,
or the edit with its colour change leaking into the rest). Sigma from SD3's logit-normal density, AdamW and an EMA
of the weights; the velocity is the adapter's own (:class:`flowrl.models.flux_kontext.FluxKontextAdapter`), so what
it learns is what the trainer samples. Resumable; the held-out edit accuracy of the EMA weights every
``eval_every`` steps. The exported model (EMA weights, fp16 safetensors) goes to ``assets/tiny_shapes_edit/`` with
the command and wall time beside it.
"""

from __future__ import annotations

import json
import random
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ..config import TinyModelConfig
from ..errors import FlowRLError
from ..resources import assets_dir
from .domain import ShapeSpec, render, split_specs
from .editing import ATTRIBUTES, changed, instruction
from .pretrain import (
    _save_state,
    check_replaceable,
    export_model,
    invoked_command,
    log_progress,
    lr_factor,
    noised,
    optimizer_step,
    start_or_resume,
)

EDIT_TINY = TinyModelConfig(resolution=16, vae=False, num_layers=2, num_attention_heads=2, attention_head_dim=64,
                            text_hidden=32, text_layers=2, max_tokens=16, shift=1.0, init_seed=0)
COMPONENTS = ("transformer", "text_encoder", "text_encoder_2")
EVAL_STEPS = 10


def random_edit(spec: ShapeSpec, rng: random.Random) -> tuple[str, ShapeSpec]:
    """(instruction, target spec): one random attribute of ``spec`` changed."""
    attribute = rng.choice(ATTRIBUTES)
    value, target = changed(spec, attribute, rng)
    return instruction(attribute, spec, value), target


def over_edited_target(spec: ShapeSpec, target: ShapeSpec) -> ShapeSpec:
    """The asked edit with the colour change leaking into the rest of the image: the other colour takes the one the
    edit replaced (a recoloured shape's old colour becomes the background, a new background's old colour the
    shape's), and a shape edit swaps the two colours. So the edit never keeps all the attributes it was not asked
    to change."""
    if target.color != spec.color:
        return ShapeSpec(target.shape, target.color, spec.color)
    if target.background != spec.background:
        return ShapeSpec(target.shape, spec.background, target.background)
    return ShapeSpec(target.shape, spec.background, spec.color)


def imperfect_target(spec: ShapeSpec, target: ShapeSpec, rng: random.Random, missed: float,
                     over_edited: float) -> ShapeSpec:
    """The target an imperfect editing dataset pairs with the instruction: with probability ``missed`` the source
    unchanged (the edit was not made), with probability ``over_edited`` :func:`over_edited_target` (the edit changed
    more than it was asked to), otherwise ``target``."""
    draw = rng.random()
    if draw < missed:
        return spec
    if draw < missed + over_edited:
        return over_edited_target(spec, target)
    return target


def edit_batch(specs, batch: int, rng: random.Random, res: int, missed: float = 0.0,
               over_edited: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """(source (B, 3, H, W), target (B, 3, H, W), both in [-1, 1], instructions) of ``batch`` random edit pairs; a
    pair's two images share their render seed, so the shape keeps its size and position. ``missed`` /
    ``over_edited``: shares of imperfect pairs (:func:`imperfect_target`)."""
    sources, targets, texts = [], [], []
    for _ in range(batch):
        spec = specs[rng.randrange(len(specs))]
        text, target = random_edit(spec, rng)
        seed = rng.randrange(10_000)
        if missed > 0 or over_edited > 0:  # no draw otherwise: a clean run keeps its random stream
            target = imperfect_target(spec, target, rng, missed, over_edited)
        sources.append(render(spec, res, seed))
        targets.append(render(target, res, seed))
        texts.append(text)

    def to_tensor(images):
        return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 127.5 - 1.0

    return to_tensor(sources), to_tensor(targets), texts


def _adapter(pipe):
    from ..models.flux_kontext import FluxKontextAdapter

    return FluxKontextAdapter(pipe, max_sequence_length=EDIT_TINY.max_tokens, resolution=EDIT_TINY.resolution)


def _train_mode(pipe) -> None:
    for name in COMPONENTS:
        getattr(pipe, name).train().requires_grad_(True)


@contextmanager
def sampling_ema_weights(pipe, params, ema):
    """The EMA weights in place and a fresh adapter that samples them (its caches empty); afterwards the trained
    weights are back and every component trains again."""
    ema.store(params)
    ema.copy_to(params)
    try:
        yield _adapter(pipe)
    finally:
        ema.restore(params)
        _train_mode(pipe)


def edit_sampler(adapter, steps: int = EVAL_STEPS):
    """``sampler(requests, seeds)`` -> (R * S, 3, H, W) ODE edits without guidance, request-major."""
    from ..sampling import sample_images

    sigmas = adapter.default_sigmas(steps, EDIT_TINY.resolution)
    shape = adapter.latent_shape(EDIT_TINY.resolution)
    return lambda requests, seeds: sample_images(adapter, requests, list(seeds), sigmas, shape)


def heldout_edit_readout(adapter, seeds=(0, 1)) -> dict:
    """Held-out edit accuracy (every held-out source x every attribute x ``seeds``, 10 ODE steps)."""
    from .editing import edit_accuracy

    return edit_accuracy(edit_sampler(adapter), list(seeds))


def _grid(adapter, path: Path, title: str) -> None:
    """Source | edit for one request per held-out source (the first six), two seeds."""
    from ..editing import source_tensor
    from ..report import save_grid
    from .editing import heldout_edit_prompts

    requests = heldout_edit_prompts()[::12][:6]
    edits = edit_sampler(adapter)(requests, [0, 1])  # (6 * 2, 3, H, W)
    sources = source_tensor(requests, EDIT_TINY.resolution)
    rows = torch.cat([torch.cat([sources[i: i + 1], edits[2 * i: 2 * i + 2]]) for i in range(len(requests))])
    save_grid(rows, 3, path, row_labels=[str(r) for r in requests], title=title)


def pretrain_tiny_edit(work_dir: str | Path = "runs/pretrain-tiny-edit", steps: int = 3000, batch: int = 32,
                       lr: float = 1e-3, seed: int = 0, ema_decay: float = 0.995, save_every: int = 250,
                       eval_every: int = 500, export_dir: str | Path | None = None, progress: bool = True,
                       instruction_dropout: float = 0.0, missed: float = 0.0, over_edited: float = 0.0) -> Path:
    """Pretrain the tiny editing model and export it (see the module's text). ``instruction_dropout`` > 0 replaces
    that share of the instructions with the empty one (the source stays), so the model also learns the
    unconditional edit that classifier-free guidance needs. ``missed`` and ``over_edited`` make that share of the
    pairs imperfect, as automatically made editing datasets are: the target is the unchanged source, or the colour
    change leaks into an attribute the instruction did not ask for (:func:`imperfect_target`). A model pretrained
    on them follows instructions only as often as its data did, which reinforcement learning can then raise."""
    if missed < 0 or over_edited < 0 or missed + over_edited > 1:
        raise FlowRLError(f"missed ({missed}) and over_edited ({over_edited}) are shares of the pairs: each at least "
                          "0 and together at most 1")
    from diffusers.training_utils import EMAModel

    from ..models.tiny import build_tiny_flux_kontext_pipeline

    work_dir = Path(work_dir)
    out = Path(export_dir) if export_dir else assets_dir() / "tiny_shapes_edit"
    check_replaceable(out, "--export-dir")  # before any work: an export never replaces a folder it did not write
    torch.manual_seed(seed)
    pipe = build_tiny_flux_kontext_pipeline(EDIT_TINY, seed=seed, pixel_space=True)
    adapter = _adapter(pipe)
    params = [p for name in COMPONENTS for p in getattr(pipe, name).parameters()]
    _train_mode(pipe)
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
    ema = EMAModel(params, decay=ema_decay)
    train_specs = split_specs()[0]
    step, elapsed, commands, rng, gen = start_or_resume(work_dir, pipe, optimizer, ema, COMPONENTS,
                                                        "pretrain-tiny-edit", "pretrain_tiny_edit", seed)
    command = invoked_command("pretrain-tiny-edit", "pretrain_tiny_edit")
    n_params = sum(p.numel() for p in pipe.transformer.parameters())
    n_text = sum(p.numel() for n in COMPONENTS[1:] for p in getattr(pipe, n).parameters())
    bar = tqdm(total=steps, initial=step, desc="pretrain-edit", disable=not progress)
    loss_ema, readout = None, None
    t_start = time.perf_counter() - elapsed
    while step < steps:
        source, target, texts = edit_batch(train_specs, batch, rng, EDIT_TINY.resolution, missed, over_edited)
        if instruction_dropout > 0:
            texts = ["" if rng.random() < instruction_dropout else t for t in texts]
        embeds, pooled, _ = pipe.encode_prompt(prompt=texts, prompt_2=texts, device="cpu",
                                               max_sequence_length=EDIT_TINY.max_tokens)
        sigma = torch.sigmoid(torch.randn(batch, generator=gen))  # SD3 logit-normal(0, 1)
        x, flow = noised(target, sigma, gen)
        # the adapter's velocity: [noisy image; source] tokens, read off the image's; (B, 3, H, W)
        cond = type("Cond", (), {"embeds": embeds, "pooled": pooled, "reference": source[:, None]})
        v = adapter._forward(x, sigma, cond)
        loss = torch.nn.functional.mse_loss(v, flow)
        optimizer_step(loss, optimizer, params, ema, lr * lr_factor(step, steps, None, 1.0))
        step += 1
        loss_value = float(loss.detach())
        loss_ema = loss_value if loss_ema is None else 0.98 * loss_ema + 0.02 * loss_value
        bar.update(1)
        bar.set_postfix(loss=f"{loss_ema:.4f}")
        if step % save_every == 0 or step == steps:
            _save_state(work_dir / "state", pipe, optimizer, ema, step, time.perf_counter() - t_start, commands, COMPONENTS)
        if eval_every > 0 and (step % eval_every == 0 or step == steps):
            with sampling_ema_weights(pipe, params, ema) as sampling:
                readout = heldout_edit_readout(sampling)
                _grid(sampling, work_dir / "grids" / f"step_{step:06d}.png",
                      f"pretraining step {step}: source | two edits (EMA, 10 ODE steps)")
            record = {"step": step, "minutes": round((time.perf_counter() - t_start) / 60, 1), "loss": loss_ema,
                      **{k: readout[k] for k in ("edit", "asked", "kept", "per_attribute")}}
            log_progress(work_dir, record, bar)
    bar.close()
    steps = max(steps, step)
    wall = time.perf_counter() - t_start
    log = work_dir / "progress.jsonl"
    if readout is None and log.is_file():  # exported from a saved state: its last readout, when it is this step's
        last = json.loads(log.read_text().splitlines()[-1])
        if last["step"] == step:
            readout, loss_ema = {k: last[k] for k in ("edit", "asked", "kept", "per_attribute")}, last["loss"]
    ema.copy_to(params)
    meta = {"command": command, "commands": commands, "steps": steps, "batch": batch, "lr": lr, "seed": seed,
            "ema_decay": ema_decay, "instruction_dropout": instruction_dropout,
            "missed": missed, "over_edited": over_edited, "wall_time_s": round(wall, 1), "final_loss_ema": loss_ema,
            "transformer_params": n_params, "text_encoder_params": n_text, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "config": EDIT_TINY.__dict__, "heldout_readout": readout}
    export_model(pipe, out, meta, COMPONENTS)
    print(json.dumps({"exported": str(out), "wall_time_min": round(wall / 60, 1), "loss": loss_ema}))
    return out
