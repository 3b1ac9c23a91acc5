"""Checkpoints: LoRA weights in diffusers' format (``StableDiffusion3Pipeline.load_lora_weights`` loads
them), or the full transformer; plus optimizer, EMA and counters for exact resume.

Each checkpoint is written to a temporary folder and renamed into place, so a crash never leaves a
half-written checkpoint. Weights load only as safetensors or ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from .errors import FlowRLError

LORA_FILE = "pytorch_lora_weights.safetensors"
STATE_FILE = "trainer_state.pt"


def lora_state_dict(transformer) -> dict[str, torch.Tensor]:
    from peft.utils import get_peft_model_state_dict

    return {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(transformer).items()}


def save_checkpoint(ckpt_dir: Path, adapter, transformer, optimizer, iteration: int, lora: bool, ema=None,
                    extra: dict | None = None, keep: int = 2) -> Path:
    """``adapter.save_lora`` writes LoRA weights in its family's diffusers format; full fine-tuning saves the
    transformer with ``save_pretrained`` (safetensors)."""
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_dir.with_name(f".{ckpt_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    if lora:
        # the adapter metadata (rank, alpha, targets) lets diffusers rebuild the same scale alpha / r
        peft_cfg = transformer.peft_config["default"].to_dict()
        meta = {k: (sorted(v) if isinstance(v, set) else v) for k, v in peft_cfg.items()}
        adapter.save_lora(tmp, lora_state_dict(transformer), meta)
    else:
        transformer.save_pretrained(str(tmp / "transformer"), safe_serialization=True)
    state = {"optimizer": optimizer.state_dict(), "iteration": iteration}
    if ema is not None:
        state["ema"] = ema.state_dict()
    torch.save(state, tmp / STATE_FILE)
    (tmp / "state.json").write_text(json.dumps({"iteration": iteration, "lora": lora, **(extra or {})}, indent=1))
    if ckpt_dir.exists():
        shutil.rmtree(ckpt_dir)
    os.replace(tmp, ckpt_dir)
    # keep the newest `keep` checkpoints
    ckpts = sorted(p for p in ckpt_dir.parent.glob("iter_*") if p.is_dir())
    for old in ckpts[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return ckpt_dir


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckpts = sorted(p for p in (Path(run_dir) / "checkpoints").glob("iter_*") if (p / "state.json").is_file())
    return ckpts[-1] if ckpts else None


def find_checkpoint(path: str | Path, iteration: int | None = None) -> Path:
    """A checkpoint folder, or a run directory's latest checkpoint (or the one saved after ``iteration``)."""
    path = Path(path)
    if (path / "checkpoints").is_dir():
        if iteration is None:
            ckpt = latest_checkpoint(path)
            if ckpt is None:
                raise FlowRLError(f"{path}: no checkpoint under {path}/checkpoints")
            return ckpt
        ckpt = path / "checkpoints" / f"iter_{iteration:05d}"
        if not (ckpt / "state.json").is_file():
            have = sorted(int(p.name[5:]) for p in (path / "checkpoints").glob("iter_*") if (p / "state.json").is_file())
            raise FlowRLError(f"{path}: no checkpoint at iteration {iteration}; saved: {have}")
        return ckpt
    if not (path / "state.json").is_file():
        raise FlowRLError(f"{path}: neither a run directory nor a flowrl checkpoint folder")
    return path


def checkpoint_is_lora(ckpt_dir: Path) -> bool:
    return bool(json.loads((Path(ckpt_dir) / "state.json").read_text()).get("lora", True))


def load_full_into(transformer, ckpt_dir: Path) -> None:
    """Full fine-tuning weights (safetensors from ``save_pretrained``) into a transformer of the same config."""
    files = sorted((Path(ckpt_dir) / "transformer").glob("*.safetensors"))
    if not files:
        raise FlowRLError(f"{ckpt_dir}: no transformer weights (transformer/*.safetensors)")
    sd = {}
    for f in files:
        sd.update(load_file(str(f)))
    missing, unexpected = transformer.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise FlowRLError(f"{ckpt_dir}: weights do not match this transformer (missing {list(missing)[:3]}, "
                          f"unexpected {list(unexpected)[:3]}); use the run's own config.yaml")


def load_lora_into(transformer, ckpt_dir: Path) -> None:
    """Load a diffusers-format LoRA file into a transformer that already has the same adapter config."""
    from peft.utils import set_peft_model_state_dict

    path = Path(ckpt_dir) / LORA_FILE
    if not path.is_file():
        raise FlowRLError(f"{ckpt_dir}: no {LORA_FILE}; is this a flowrl LoRA checkpoint?")
    try:
        sd = load_file(str(path))
    except Exception as exc:
        raise FlowRLError(f"{path}: unreadable safetensors file ({exc})") from exc
    sd = {k.removeprefix("transformer."): v for k, v in sd.items()}
    result = set_peft_model_state_dict(transformer, sd)
    unexpected = getattr(result, "unexpected_keys", None) or []
    if unexpected:
        raise FlowRLError(f"{path}: keys do not match this model's LoRA (first: {unexpected[:3]}); check train.lora "
                          "rank/targets match the run that wrote it")


def load_trainer_state(ckpt_dir: Path) -> dict:
    path = Path(ckpt_dir) / STATE_FILE
    if not path.is_file():
        raise FlowRLError(f"{ckpt_dir}: no {STATE_FILE}; cannot resume from it")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise FlowRLError(f"{path}: unreadable trainer state ({type(exc).__name__}: {str(exc).splitlines()[0]})") from exc
