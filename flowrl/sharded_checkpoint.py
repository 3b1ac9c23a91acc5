"""Checkpoints of sharded runs (``train.fsdp``), through ``torch.distributed.checkpoint`` (DCP).

Every process writes its own shards of the trained weights, the optimizer state, the EMA and the old policy into
``<checkpoint>/sharded/`` (DCP's format: one file per process plus ``.metadata``); the main process adds
``state.json`` (iteration, world size, algorithm state, EMA counters) and, for LoRA, the consolidated
``pytorch_lora_weights.safetensors`` that ``load_lora_weights`` reads. The folder is written under a temporary
name and renamed into place after every process has finished, so a crash during a save leaves the previous
checkpoint whole.

DCP reshards on load: a checkpoint written by N processes loads into M processes, or into one plain
(unsharded) transformer (``flowrl export``, ``flowrl sample``, ``flowrl eval``). An exact resume needs the same
world size (``train.fsdp.resume_other_world_size`` allows another).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import torch

from .errors import ConfigError, FlowRLError

SHARDED_DIR = "sharded"
# Fault injection for the crash-safety test: the process of this rank is killed (SIGKILL) in the middle of the
# save of this iteration's checkpoint, after its shards are written and before the folder is complete.
KILL_DURING_SAVE = "FLOWRL_TEST_KILL_DURING_SAVE"  # "<iteration>:<rank>"


def lora_state_dict(transformer) -> dict[str, torch.Tensor]:
    """The transformer's LoRA layers as diffusers saves them, whole, on the CPU. Sharded (train.fsdp), every
    process must call it: each tensor is gathered from every process, in the same order."""
    from peft.utils import get_peft_model_state_dict

    from .sharding import full

    return {k: full(v.detach()).cpu().contiguous() for k, v in get_peft_model_state_dict(transformer).items()}


def lora_metadata(transformer) -> dict:
    """The adapter's settings (rank, alpha, targets) saved beside the LoRA file, so diffusers rebuilds the same
    scale alpha / r."""
    peft_cfg = transformer.peft_config["default"].to_dict()
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in peft_cfg.items()}


def trainable(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in module.named_parameters() if p.requires_grad}


def _raw_optimizer(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds the torch optimizer


def _state(policy, with_optimizer: bool | None = None) -> dict:
    """What DCP writes and reads, keyed by parameter name; the values are the live tensors (loads are in place)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from .sharding import reshard

    module = policy.module
    reshard(module)
    names = list(trainable(module))
    state = {"model": trainable(module)}
    # before the first step the optimizer has no state, and asking DCP for it would make some (a zero-gradient
    # step that advances Adam's step count): a checkpoint taken then (the held-out curve's first best) has none
    # (``with_optimizer=None``: when it has state; True: always, to load into)
    if with_optimizer or (with_optimizer is None and _raw_optimizer(policy.optimizer).state):
        state["optimizer"] = get_optimizer_state_dict(module, _raw_optimizer(policy.optimizer))
    if policy.ema is not None:
        state["ema"] = dict(zip(names, policy.ema.shadow_params))
    if policy.old is not None:
        state["old"] = dict(zip(names, policy.old))
    return state


def _ema_counters(ema) -> dict:
    return {k: v for k, v in ema.state_dict().items() if k != "shadow_params" and isinstance(v, (int, float, bool))}


def save_sharded_checkpoint(ckpt_dir: Path, policy, adapter, procs, iteration: int, extra: dict | None = None,
                            keep: int = 2) -> Path:
    """Every process calls it; returns the checkpoint folder once it is complete on disk."""
    import torch.distributed.checkpoint as dcp

    ckpt_dir = Path(ckpt_dir)
    tmp = ckpt_dir.with_name(f".{ckpt_dir.name}.tmp")
    if procs.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # what a crashed save left
        tmp.mkdir(parents=True)
    procs.barrier()
    dcp.save(_state(policy), checkpoint_id=str(tmp / SHARDED_DIR))
    _maybe_killed(iteration, procs.global_rank)
    lora = lora_state_dict(policy.module) if policy.lora else None  # gathered on every process (collective)
    if procs.is_main:
        if lora is not None:
            adapter.save_lora(tmp, lora, lora_metadata(policy.module))
        info = {"iteration": iteration, "lora": policy.lora, "sharded": {"world_size": procs.processes},
                **({"ema": _ema_counters(policy.ema)} if policy.ema is not None else {}), **(extra or {})}
        (tmp / "state.json").write_text(json.dumps(info, indent=1))
    procs.barrier()  # every shard is on disk before the folder takes its name
    if procs.is_main:
        if ckpt_dir.exists():
            shutil.rmtree(ckpt_dir)
        os.replace(tmp, ckpt_dir)
        if ckpt_dir.name.startswith("iter_"):
            for old in sorted(p for p in ckpt_dir.parent.glob("iter_*") if p.is_dir())[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    procs.barrier()
    return ckpt_dir


def _maybe_killed(iteration: int, rank: int) -> None:
    spec = os.environ.get(KILL_DURING_SAVE, "")
    if spec and spec == f"{iteration}:{rank}":
        os.kill(os.getpid(), signal.SIGKILL)


def is_sharded_checkpoint(ckpt: Path) -> bool:
    return (Path(ckpt) / SHARDED_DIR).is_dir()


def saved_world_size(ckpt: Path) -> int | None:
    """The number of processes that wrote a sharded checkpoint (None for an unsharded one)."""
    try:
        info = json.loads((Path(ckpt) / "state.json").read_text()).get("sharded")
    except (OSError, ValueError):
        return None
    return int(info["world_size"]) if info else None


def check_resume(ckpt: Path, cfg, world: int) -> None:
    """One line, before any model loads, when the checkpoint and the launch cannot continue one another."""
    saved = saved_world_size(ckpt)
    sharded = cfg.train.fsdp.enabled
    if saved is None and sharded:
        raise ConfigError(f"resume: {ckpt} was written by an unsharded run; resume it with train.fsdp.enabled=false")
    if saved is not None and not sharded:
        raise ConfigError(f"resume: {ckpt} was written by a sharded run (train.fsdp); resume it with "
                          "train.fsdp.enabled=true")
    if saved is not None and saved != world and not cfg.train.fsdp.resume_other_world_size:
        raise ConfigError(f"resume: {ckpt} was written by {saved} processes and this launch has {world}; launch "
                          f"{saved} for an exact resume, or set train.fsdp.resume_other_world_size=true (equal up to "
                          "float reduction order)")


def load_sharded_state(ckpt: Path, policy) -> dict:
    """Weights, optimizer, EMA and old policy of a sharded checkpoint into a sharded policy (any world size);
    returns state.json."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    from torch.distributed.checkpoint import FileSystemReader

    info = json.loads((Path(ckpt) / "state.json").read_text())
    saved = FileSystemReader(str(Path(ckpt) / SHARDED_DIR)).read_metadata().state_dict_metadata
    state = _state(policy, with_optimizer=any(k.startswith("optimizer") for k in saved))
    try:
        dcp.load(state, checkpoint_id=str(Path(ckpt) / SHARDED_DIR))
    except Exception as exc:  # noqa: BLE001 (DCP reports missing keys and shapes through several exception types)
        raise FlowRLError(f"{ckpt}: its sharded state does not fit this model ({str(exc).splitlines()[0][:200]}); "
                          "resume with the run's own config.yaml") from exc
    if "optimizer" in state:
        set_optimizer_state_dict(policy.module, _raw_optimizer(policy.optimizer), state["optimizer"])
    if policy.ema is not None and "ema" in info:
        policy.ema.optimization_step = info["ema"].get("optimization_step", policy.ema.optimization_step)
    return info


def load_sharded_weights(module: torch.nn.Module, ckpt: Path) -> None:
    """The trained weights of a sharded checkpoint, in place, into ``module``: a plain transformer in one process
    (any saved world size), or the sharded one of a running job (every process calls it)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    lora = hasattr(module, "peft_config")
    params = {n: p for n, p in module.named_parameters() if "lora_" in n} if lora else dict(module.named_parameters())
    state = {"model": {n: p.data if not _is_dtensor(p) else p for n, p in params.items()}}
    try:
        dcp.load(state, checkpoint_id=str(Path(ckpt) / SHARDED_DIR), no_dist=not dist.is_initialized())
    except Exception as exc:  # noqa: BLE001
        raise FlowRLError(f"{ckpt}: its sharded weights do not fit this model ({str(exc).splitlines()[0][:200]})") from exc


def _is_dtensor(t) -> bool:
    from .sharding import is_sharded

    return is_sharded(t)
