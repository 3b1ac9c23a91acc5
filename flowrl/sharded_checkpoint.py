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

Loading unpickles nothing but data: DCP reads ``.metadata`` with ``pickle.load`` and its non-tensor entries with an
unrestricted torch unpickler (``weights_only`` off), so a crafted run folder could run code on ``resume``; here the
metadata goes through an unpickler that admits only DCP's own records, and every entry through ``weights_only``.
"""

from __future__ import annotations

import io
import json
import os
import pickle
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
        from .digests import write_digests

        write_digests(tmp)  # every process's shards are on disk (dcp.save has finished on all of them)
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


# What a DCP checkpoint's .metadata pickle may name: DCP's own metadata records, the tensor facts they hold and the
# checkpoint's path. Anything else (a function to call, a class that runs code when built) means the file was not
# written by DCP, and is refused before it can run.
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
     ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"), ("pathlib", "Path"),
     ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                   torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which a checkpoint's metadata never holds")


def _safe_reader(folder: Path):
    """DCP's file reader with its ``.metadata`` read by :class:`_MetadataUnpickler` instead of ``pickle.load``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            path = Path(folder) / ".metadata"
            try:
                with open(path, "rb") as fh:
                    metadata = _MetadataUnpickler(fh).load()
            except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as exc:
                raise FlowRLError(f"{path}: refused to read it ({str(exc).splitlines()[0][:200] or type(exc).__name__}): "
                                  "a damaged or foreign checkpoint; use another checkpoint of the run") from exc
            from torch.distributed.checkpoint.metadata import Metadata

            if not isinstance(metadata, Metadata):  # a number, a list: well-formed pickle, not DCP's record
                raise FlowRLError(f"{path}: holds a {type(metadata).__name__}, not a checkpoint's metadata: a damaged "
                                  "or foreign checkpoint; use another checkpoint of the run")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(folder))


def _safe_planner():
    """DCP's load planner with its non-tensor entries (optimizer hyper-parameters, counters) read by
    ``torch.load(weights_only=True)``: plain numbers, strings and containers only (DCP reads them with
    ``weights_only=False``, which would run whatever a crafted file holds)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafePlanner(DefaultLoadPlanner):
        refused: str | None = None  # DCP wraps a planner's error in its own: the refusal is kept here too

        def load_bytes(self, read_item, value):
            try:
                vetted = torch.load(value, weights_only=True)
            except Exception as exc:  # noqa: BLE001 (the unpickler's refusal, or a cut file)
                first = next((line.strip() for line in str(exc).splitlines() if "global" in line.lower()),
                             str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                self.refused = (f"a sharded checkpoint's entry {read_item.dest_index.fqn} is not plain data "
                                f"({first[:160]}); refused to load it")
                raise FlowRLError(self.refused) from exc
            buffer = io.BytesIO()
            torch.save(vetted, buffer)  # what DCP then reads back is this vetted copy
            buffer.seek(0)
            super().load_bytes(read_item, buffer)

    return SafePlanner()


def read_sharded_metadata(ckpt: Path):
    """A sharded checkpoint's DCP metadata, read safely (:class:`_MetadataUnpickler`)."""
    return _safe_reader(Path(ckpt) / SHARDED_DIR).read_metadata()


def load_dcp(state: dict, ckpt: Path, **kwargs) -> None:
    """``torch.distributed.checkpoint.load`` of a checkpoint's sharded folder, with the safe metadata reader and
    planner: nothing in the folder is unpickled beyond plain data and DCP's own records."""
    import torch.distributed.checkpoint as dcp

    folder = Path(ckpt) / SHARDED_DIR
    reader, planner = _safe_reader(folder), _safe_planner()
    reader.read_metadata()  # a refusal here is one line (inside dcp.load, DCP wraps it in a traceback per rank)
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    try:
        dcp.load(state, storage_reader=reader, planner=planner, **kwargs)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001
        if planner.refused:
            raise FlowRLError(planner.refused) from exc
        raise


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
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    info = json.loads((Path(ckpt) / "state.json").read_text())
    saved = read_sharded_metadata(ckpt).state_dict_metadata
    state = _state(policy, with_optimizer=any(k.startswith("optimizer") for k in saved))
    try:
        load_dcp(state, ckpt)
    except FlowRLError:
        raise
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 (DCP reports missing keys and shapes several ways)
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
    from torch.distributed.checkpoint.api import CheckpointException

    lora = hasattr(module, "peft_config")
    params = {n: p for n, p in module.named_parameters() if "lora_" in n} if lora else dict(module.named_parameters())
    state = {"model": {n: p.data if not _is_dtensor(p) else p for n, p in params.items()}}
    try:
        load_dcp(state, ckpt, no_dist=not dist.is_initialized())
    except FlowRLError:
        raise
    except (Exception, CheckpointException) as exc:  # noqa: BLE001
        raise FlowRLError(f"{ckpt}: its sharded weights do not fit this model ({str(exc).splitlines()[0][:200]})") from exc


def _is_dtensor(t) -> bool:
    from .sharding import is_sharded

    return is_sharded(t)
