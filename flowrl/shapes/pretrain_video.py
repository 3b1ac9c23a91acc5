"""``flowrl pretrain-tiny-video``: pretrain the embedded tiny text-to-video model on the moving-shapes domain.

A pixel-space Wan 2.1-architecture transformer (diffusers ``WanTransformer3DModel``) and a tiny UMT5 encoder,
trained jointly on the rectified-flow objective ``|| v_theta(x_sigma, sigma, c) - (eps - x0) ||^2`` over whole
clips (B, 3, F, H, W), sigma from SD3's logit-normal density, 10% caption dropout (so CFG works), AdamW and an EMA
of the weights. Resumable; every ``eval_every`` steps the EMA weights draw the held-out captions and the checker
reads them back (``progress.jsonl``, a video grid). The exported model (EMA weights, fp16 safetensors) goes to
``assets/tiny_moving_shapes/`` with the command and wall time beside it.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ..errors import FlowRLError
from ..resources import assets_dir
from .moving import FRAMES, RESOLUTION, heldout_prompts, render_video, split_specs
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

COMPONENTS = ("transformer", "text_encoder")
MAX_TOKENS = 16


def clips_batch(specs, batch: int, rng: random.Random) -> tuple[torch.Tensor, list[str]]:
    """(x0 (B, 3, F, H, W) in [-1, 1], captions) of ``batch`` random training clips."""
    chosen = [specs[rng.randrange(len(specs))] for _ in range(batch)]
    clips = np.stack([render_video(s, RESOLUTION, FRAMES, rng.randrange(1 << 30)) for s in chosen])  # (B, F, H, W, 3)
    x0 = torch.from_numpy(clips).permute(0, 4, 1, 2, 3).float() / 127.5 - 1.0
    return x0, [s.prompt for s in chosen]


@torch.no_grad()
def heldout_readout(pipe, seeds=(0, 1), steps: int = 10, guidance_scale: float = 4.5, grid_path: Path | None = None):
    """Held-out accuracy of the current weights: every held-out caption x ``seeds``, ODE, checker readout."""
    from ..models.wan import WanAdapter
    from ..report import save_grid
    from ..samplers import make_sigmas
    from ..sampling import sample_images
    from .evaluate import moving_shapes_accuracy

    adapter = WanAdapter(pipe, max_sequence_length=MAX_TOKENS, num_frames=FRAMES)
    sigmas = make_sigmas("diffusers", steps, scheduler_config=dict(pipe.scheduler.config))
    negative = adapter.encode_prompts([""])

    def sampler(prompts, s):
        return sample_images(adapter, prompts, list(s), sigmas, adapter.latent_shape(RESOLUTION), guidance_scale, negative)

    result, videos = moving_shapes_accuracy(sampler, list(seeds), return_images=True)
    if grid_path is not None:
        held = heldout_prompts()
        picks = list(range(0, len(held), len(held) // 6))[:6]
        chosen = torch.cat([videos[i * len(seeds): (i + 1) * len(seeds)] for i in picks])
        save_grid(chosen, len(seeds), grid_path, row_labels=[held[i] for i in picks],
                  title="held-out captions, EMA weights, 10 ODE steps, CFG 4.5")
    return result


def _same_shapes(module: torch.nn.Module, path: Path) -> bool:
    from safetensors import safe_open

    own = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    with safe_open(str(path), "pt") as fh:
        return all(own.get(k) == tuple(fh.get_slice(k).get_shape()) for k in fh.keys())


def training_sigmas(batch: int, shift: float, gen: torch.Generator, below: float | None = None) -> torch.Tensor:
    """(B,) training sigmas: SD3's logit-normal(0, 1), then the time shift; with ``below``, drawn again until every
    sigma lies under it (a low-noise expert learns only its own range, as Wan 2.2's do)."""
    def draw(n):
        sigma = torch.sigmoid(torch.randn(n, generator=gen))
        return shift * sigma / (1 + (shift - 1) * sigma)

    sigma = draw(batch)
    while below is not None and bool((over := sigma >= below).any()):
        sigma[over] = draw(int(over.sum()))
    return sigma


def _warm_start(pipe, source: Path, text: bool) -> None:
    """The transformer (and with ``text`` the text encoder, when its shapes match) of a pretraining state folder
    (``<work-dir>/state``) or of an exported one-transformer model folder."""
    from safetensors.torch import load_model

    from .video_model import load_tiny_moving_shapes_pipeline

    if (source / "transformer.safetensors").is_file():  # a pretraining state folder
        load_model(pipe.transformer, str(source / "transformer.safetensors"))
        text_file = source / "text_encoder.safetensors"
        if text and text_file.is_file() and _same_shapes(pipe.text_encoder, text_file):  # same tokenizer
            load_model(pipe.text_encoder, str(text_file))
    elif (source / "transformer" / "config.json").is_file():  # an exported model
        exported = load_tiny_moving_shapes_pipeline(source)
        want, got = tuple(pipe.transformer.config.patch_size), tuple(exported.transformer.config.patch_size)
        if want != got:
            raise FlowRLError(f"--init-from {source}: its transformer has patch {got}, this run's {want}; set "
                              f"--patch-size {' '.join(map(str, got))} or start from another model")
        pipe.transformer.load_state_dict(exported.transformer.state_dict())
        if text:
            pipe.text_encoder.load_state_dict(exported.text_encoder.state_dict())
    else:
        raise FlowRLError(f"--init-from {source}: neither a pretraining state folder (transformer.safetensors) nor "
                          "an exported model folder (transformer/config.json)")


def _two_experts(high, low_pipe, boundary: float):
    """A Wan 2.2-style pipeline: ``high``'s transformer above ``boundary`` (x 1000 timesteps), ``low_pipe``'s below,
    one text encoder (the high-noise expert's)."""
    from diffusers import WanPipeline

    return WanPipeline(tokenizer=high.tokenizer, text_encoder=high.text_encoder, vae=None, scheduler=high.scheduler,
                       transformer=high.transformer, transformer_2=low_pipe.transformer, boundary_ratio=boundary)


def pretrain_tiny_video(work_dir: str | Path = "runs/pretrain-tiny-video", steps: int = 6000, batch: int = 32,
                        lr: float = 1e-3, seed: int = 0, ema_decay: float = 0.999, caption_dropout: float = 0.1,
                        save_every: int = 250, eval_every: int = 1000, export_dir: str | Path | None = None,
                        progress: bool = True, decay_from: int | None = None, lr_final: float = 0.1,
                        shift: float = 1.0, init_from: str | Path | None = None, motion_weight: float = 0.0,
                        patch_size: tuple[int, int, int] | None = None, high_noise_expert: str | Path | None = None,
                        boundary: float = 0.875) -> Path:
    """With ``high_noise_expert`` (an exported model folder), train a Wan 2.2-style low-noise expert instead: the
    transformer learns only sigmas below ``boundary`` and reads that model's text encoder, frozen, so that one
    encoder serves both; the readouts and the export are the two-expert model (``transformer`` = the high-noise
    expert as given, ``transformer_2`` = this one)."""
    from diffusers.training_utils import EMAModel

    from .video_model import MOVING_SHAPES_TINY, build_tiny_moving_shapes_pipeline, load_tiny_moving_shapes_pipeline

    work_dir = Path(work_dir)
    out = Path(export_dir) if export_dir else assets_dir() / "tiny_moving_shapes"
    check_replaceable(out, "--export-dir")  # before any work: an export never replaces a folder it did not write
    torch.manual_seed(seed)
    from diffusers import FlowMatchEulerDiscreteScheduler

    # patch_size (4, 4, 4): every token holds the four frames in order. With the default (1, 4, 4) the direction
    # word was never learned; with (4, 4, 4) motion rose from 25% to 99% between steps 13,000 and 16,000 (CHANGELOG.md)
    pipe = build_tiny_moving_shapes_pipeline(seed=seed, patch_size=patch_size)
    # The time shift moves training sigmas (and the sampling grid) toward high noise, where the clip's layout and
    # path are decided: with SD3's logit-normal(0, 1) alone only 1.4% of the draws have sigma > 0.9.
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    components, high = COMPONENTS, None
    if high_noise_expert is not None:
        # Wan 2.2's layout: the high-noise expert decides the layout and the path (the temporal-patch model learns
        # the direction), the low-noise expert draws the detail (the (1, 4, 4) layout learns the shapes). They
        # share one text encoder: the high-noise expert's, which carries the direction.
        high = load_tiny_moving_shapes_pipeline(high_noise_expert)
        if getattr(high, "transformer_2", None) is not None:
            raise FlowRLError(f"--high-noise-expert {high_noise_expert} is already a two-expert model; give a "
                              "one-transformer export")
        pipe.text_encoder = high.text_encoder.requires_grad_(False).eval()
        components = ("transformer",)
    if init_from is not None:  # warm start: an earlier pretraining state's or export's transformer
        _warm_start(pipe, Path(init_from), text=high is None)
    params = [p for name in components for p in getattr(pipe, name).parameters()]
    for name in components:
        getattr(pipe, name).train().requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
    ema = EMAModel(params, decay=ema_decay)
    train_specs, _ = split_specs()
    step, elapsed, commands, rng, gen = start_or_resume(work_dir, pipe, optimizer, ema, components,
                                                        "pretrain-tiny-video", "pretrain_tiny_video", seed)
    command = invoked_command("pretrain-tiny-video", "pretrain_tiny_video")
    bar = tqdm(total=steps, initial=step, desc="pretrain video", disable=not progress)
    loss_ema = None
    t_start = time.perf_counter() - elapsed
    readout = None
    while step < steps:
        x0, prompts = clips_batch(train_specs, batch, rng)
        prompts = ["" if rng.random() < caption_dropout else p for p in prompts]
        embeds = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=MAX_TOKENS,
                                    device="cpu")[0]  # (B, 16, text_dim), zero past each caption's tokens
        sigma = training_sigmas(batch, shift, gen, below=boundary if high is not None else None)
        x, target = noised(x0, sigma, gen)  # (B, 3, F, H, W)
        v = pipe.transformer(hidden_states=x, timestep=sigma * 1000, encoder_hidden_states=embeds, return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(v, target)
        if motion_weight:  # the frame-to-frame change of the target, where the clip's motion lives, weighed up
            loss = loss + motion_weight * torch.nn.functional.mse_loss(v.diff(dim=2), target.diff(dim=2))
        optimizer_step(loss, optimizer, params, ema, lr * lr_factor(step, steps, decay_from, lr_final))
        step += 1
        loss_ema = loss.item() if loss_ema is None else 0.98 * loss_ema + 0.02 * loss.item()
        bar.update(1)
        bar.set_postfix(loss=f"{loss_ema:.4f}")
        if step % save_every == 0 or step == steps:
            _save_state(work_dir / "state", pipe, optimizer, ema, step, time.perf_counter() - t_start, commands, components)
        if step % eval_every == 0 or step == steps:
            ema.store(params)
            ema.copy_to(params)
            readout = heldout_readout(_two_experts(high, pipe, boundary) if high is not None else pipe,
                                      grid_path=work_dir / "grids" / f"step_{step:06d}.png")
            ema.restore(params)
            for name in components:  # the readout's adapter froze the low-noise expert it does not train
                getattr(pipe, name).train().requires_grad_(True)
            record = {"step": step, "minutes": round((time.perf_counter() - t_start) / 60, 1), "loss": loss_ema,
                      **{k: readout[k] for k in ("background", "color", "shape", "motion", "all")}}
            log_progress(work_dir, record, bar)
    bar.close()
    steps = max(steps, step)
    wall = time.perf_counter() - t_start
    ema.copy_to(params)
    meta = {"command": command, "commands": commands, "steps": steps, "batch": batch, "lr": lr,
            "decay_from": decay_from, "lr_final": lr_final, "seed": seed, "ema_decay": ema_decay,
            "caption_dropout": caption_dropout, "shift": shift, "motion_weight": motion_weight,
            "init_from": str(init_from) if init_from else None,
            "high_noise_expert": str(high_noise_expert) if high is not None else None,
            "boundary_ratio": boundary if high is not None else None, "wall_time_s": round(wall, 1), "final_loss_ema": loss_ema,
            "transformer_params": sum(p.numel() for p in pipe.transformer.parameters()),
            "text_encoder_params": sum(p.numel() for p in pipe.text_encoder.parameters()),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "config": {**MOVING_SHAPES_TINY, "patch_size": tuple(pipe.transformer.config.patch_size),
                       "resolution": RESOLUTION, "num_frames": FRAMES},
            "heldout_readout": readout}
    if high is not None:
        export_model(_two_experts(high, pipe, boundary), out, meta, ("transformer", "transformer_2", "text_encoder"))
    else:
        export_model(pipe, out, meta, COMPONENTS)
    print(json.dumps({"exported": str(out), "wall_time_min": round(wall / 60, 1), "loss": loss_ema}))
    return out
