"""Checkpoints: LoRA weights in diffusers' format (``StableDiffusion3Pipeline.load_lora_weights`` loads
them), or the full transformer; plus optimizer, EMA and counters for exact resume.

Each checkpoint is written to a temporary folder and renamed into place, so a crash never leaves a
half-written checkpoint. Weights load only as safetensors or ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from .digests import digest_problem, recorded, write_digests
from .errors import ConfigError, FlowRLError
from .sharded_checkpoint import lora_metadata, lora_state_dict  # noqa: F401 (callers import them from here too)

LORA_FILE = "pytorch_lora_weights.safetensors"
STATE_FILE = "trainer_state.pt"


def save_checkpoint(ckpt_dir: Path, adapter, transformer, optimizer, iteration: int, lora: bool, ema=None,
                    extra: dict | None = None, keep: int = 2, tensors: dict | None = None) -> Path:
    """``adapter.save_lora`` writes LoRA weights in its family's diffusers format; full fine-tuning saves the
    transformer with ``save_pretrained`` (safetensors)."""
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_dir.with_name(f".{ckpt_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        _write_checkpoint(tmp, adapter, transformer, optimizer, iteration, lora, ema, extra, tensors)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written stays behind
        if not isinstance(exc, OSError) and _disk_full(exc):  # safetensors reports a full disk as its own error
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(ckpt_dir)) from exc
        raise
    if ckpt_dir.exists():
        shutil.rmtree(ckpt_dir)
    os.replace(tmp, ckpt_dir)
    # keep the newest `keep` checkpoints
    ckpts = sorted(p for p in ckpt_dir.parent.glob("iter_*") if p.is_dir())
    for old in ckpts[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return ckpt_dir


def save_run_checkpoint(run_dir: Path, iteration: int, policy, adapter, procs, algorithm_state: dict,
                        keep: int) -> Path:
    """Iteration ``iteration``'s checkpoint of a run: the main process writes it (every process holds the same
    weights and state) and the others wait for it, so a resume that follows reads it whole; sharded, every
    process writes its shards."""
    from .sharded_checkpoint import save_sharded_checkpoint

    path = run_dir / "checkpoints" / f"iter_{iteration:05d}"
    extra = {"algorithm_state": algorithm_state}
    if policy.sharded:
        return save_sharded_checkpoint(path, policy, adapter, procs, iteration, extra=extra, keep=keep)
    if procs.is_main:
        path = save_checkpoint(path, adapter, policy.module, policy.optimizer, iteration, lora=policy.lora,
                               ema=policy.ema, extra=extra, keep=keep,
                               tensors={"old_policy": policy.old} if policy.old is not None else None)
    procs.barrier()
    return path


def resume_start(ckpt: Path, iterations: int) -> int:
    """The first iteration a resume from ``ckpt`` runs, or one line when ``train.iterations`` leaves none."""
    start = int(json.loads((ckpt / "state.json").read_text())["iteration"]) + 1
    if iterations <= start:
        raise ConfigError(f"resume: {ckpt} ends at iteration {start} and train.iterations={iterations}; raise "
                          "train.iterations to continue the run")
    return start


def _disk_full(exc: BaseException) -> bool:
    """Whether a library's own exception (safetensors: ``IoError(Os { code: 28, kind: StorageFull ... })``) says
    the disk is full."""
    text = str(exc)
    return "StorageFull" in text or f"os error {errno.ENOSPC}" in text or f"code: {errno.ENOSPC}," in text


def _write_checkpoint(tmp: Path, adapter, transformer, optimizer, iteration: int, lora: bool, ema, extra,
                      tensors=None) -> None:
    if lora:
        adapter.save_lora(tmp, lora_state_dict(transformer), lora_metadata(transformer))
    else:
        transformer.save_pretrained(str(tmp / "transformer"), safe_serialization=True)
    state = {"optimizer": optimizer.state_dict(), "iteration": iteration}
    if ema is not None:
        state["ema"] = ema.state_dict()
    state.update(tensors or {})  # further trainer state (the old policy's weights)
    torch.save(state, tmp / STATE_FILE)
    (tmp / "state.json").write_text(json.dumps({"iteration": iteration, "lora": lora, **(extra or {})}, indent=1))
    write_digests(tmp)  # last: every file's digest, checked before any load


def checkpoints_newest_first(run_dir: Path) -> list[Path]:
    return sorted((p for p in (Path(run_dir) / "checkpoints").glob("iter_*") if p.is_dir()), reverse=True)


def _safetensors_problem(path: Path) -> str | None:
    """Why a safetensors file cannot be read whole (cut short, garbage, empty), from its header alone."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if size < 8 or n <= 0 or 8 + n > size:
                return f"{path.name} is not a safetensors file (or is cut short)"
            header = json.loads(fh.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{path.name} is unreadable ({type(exc).__name__})"
    return None if 8 + n + end == size else f"{path.name} is cut short ({size} of {8 + n + end} bytes)"


def _shards_problem(ckpt: Path) -> str | None:
    """A sharded checkpoint without digests: every shard file its metadata names is present and long enough for
    the byte ranges the metadata gives it."""
    from .errors import FlowRLError
    from .sharded_checkpoint import SHARDED_DIR, read_sharded_metadata

    try:
        metadata = read_sharded_metadata(ckpt)
    except FlowRLError as exc:
        return str(exc).split(": ", 1)[-1]
    ends: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        name = str(getattr(info, "relative_path", ""))
        ends[name] = max(ends.get(name, 0), int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0)))
    for name, end in sorted(ends.items()):
        shard = Path(ckpt) / SHARDED_DIR / name
        if not shard.is_file():
            return f"{SHARDED_DIR}/{name} is missing"
        if shard.stat().st_size < end:
            return f"{SHARDED_DIR}/{name} is cut short ({shard.stat().st_size} of {end} bytes)"
    return None


_WARNED_UNVERIFIED: set[str] = set()


def _unverified_weights_problem(path: Path) -> str | None:
    """A weights file without a digest: usable only when every tensor in it is finite (said once per file)."""
    import sys

    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            for key in fh.keys():
                t = fh.get_tensor(key)
                if t.is_floating_point() and not torch.isfinite(t).all():
                    return (f"{path.name} has no digest in digests.json and holds non-finite values ({key}); it "
                            "cannot be verified")
    except Exception as exc:  # noqa: BLE001 (any failure means the file cannot be used)
        return f"{path.name} is unreadable ({type(exc).__name__})"
    if str(path) not in _WARNED_UNVERIFIED:
        _WARNED_UNVERIFIED.add(str(path))
        print(f"warning: {path} has no digest in digests.json (an older checkpoint, or its entry was removed); used "
              "because every tensor in it is finite", file=sys.stderr)
    return None


def checkpoint_problem(ckpt: Path) -> str | None:
    """None if the checkpoint folder is whole (state.json, trainer state, weights), else why not."""
    ckpt = Path(ckpt)
    try:
        state = json.loads((ckpt / "state.json").read_text())
        int(state["iteration"])
    except (OSError, ValueError, KeyError, TypeError):
        return "state.json is missing or unreadable"
    if state.get("sharded"):  # every process's shards, and the LoRA file the main process consolidated
        if not (ckpt / "sharded" / ".metadata").is_file():
            return "its sharded state (sharded/.metadata) is missing"
        weights = [ckpt / LORA_FILE] if state.get("lora", True) else []
    else:
        weights = [ckpt / LORA_FILE] if state.get("lora", True) else sorted((ckpt / "transformer").glob("*.safetensors"))
        if not weights:
            return "its weights file is missing"
    if not all(w.is_file() for w in weights):
        return "its weights file is missing"
    problem = digest_problem(ckpt)  # a cut, deleted or altered file (sharded shards included)
    if problem:
        return problem
    if state.get("sharded") and not (ckpt / "digests.json").is_file():  # an older layout: the shards themselves
        problem = _shards_problem(ckpt)
        if problem:
            return problem
    for w in weights:
        problem = _safetensors_problem(w)
        if problem:
            return problem
    covered = recorded(ckpt)
    for w in weights:  # a weights file no digest covers (an older layout, or an entry removed) is read, not trusted
        if str(w.relative_to(ckpt)) not in covered:
            problem = _unverified_weights_problem(w)
            if problem:
                return problem
    if not state.get("sharded"):
        try:  # a zip cut short fails here without reading the tensors (mmap)
            torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # noqa: BLE001 (any failure means the file cannot be used)
            return f"{STATE_FILE} is unreadable ({type(exc).__name__})"
    return None


def latest_checkpoint(run_dir: Path, quiet: bool = False) -> Path | None:
    """The newest whole checkpoint of a run; a newer broken one is named on stderr and skipped."""
    import sys

    skipped = []
    for ckpt in checkpoints_newest_first(run_dir):
        problem = checkpoint_problem(ckpt)
        if problem is None:
            if skipped and not quiet:
                print(f"flowrl: checkpoint {skipped[0][0]} is damaged ({skipped[0][1]}); using {ckpt.name}, the newest "
                      "intact one", file=sys.stderr)
            return ckpt
        skipped.append((ckpt.name, problem))
    return None


def _ended_with_best(run_dir: Path) -> Path | None:
    """checkpoints/best when the run ended with those weights (``log.keep_best`` restored them), so that a run
    directory means the weights its 'after' evaluation measured; None otherwise."""
    import json

    try:
        ended = json.loads((run_dir / "best.json").read_text()).get("ended_with", False)
    except (OSError, ValueError, AttributeError):  # absent, cut or not an object: the latest checkpoint
        return None
    best = run_dir / "checkpoints" / "best"
    return best if ended and best.is_dir() and checkpoint_problem(best) is None else None


def find_checkpoint(path: str | Path, iteration: int | None = None) -> Path:
    """A checkpoint folder, or a run directory's checkpoint: the best one when the run ended with it
    (``log.keep_best``), else its newest intact one (or the one saved after ``iteration``); a damaged checkpoint
    is refused in one line that names the newest intact one."""
    path = Path(path)
    if (path / "checkpoints").is_dir():
        if iteration is None:
            ended_with = _ended_with_best(path)
            if ended_with is not None:
                return ended_with
            ckpt = latest_checkpoint(path)
            if ckpt is None:
                raise FlowRLError(f"{path}: no intact checkpoint under {path}/checkpoints")
            return ckpt
        ckpt = path / "checkpoints" / f"iter_{iteration:05d}"
        if not ckpt.is_dir():
            have = sorted(int(p.name[5:]) for p in checkpoints_newest_first(path))
            raise FlowRLError(f"{path}: no checkpoint at iteration {iteration}; saved: {have}")
    elif path.is_dir() and (path / "state.json").exists() or path.parent.name == "checkpoints":
        ckpt = path
    else:
        raise FlowRLError(f"{path}: neither a run directory nor a flowrl checkpoint folder")
    problem = checkpoint_problem(ckpt)
    if problem:
        intact = latest_checkpoint(ckpt.parent.parent, quiet=True) if ckpt.parent.name == "checkpoints" else None
        hint = f"; the newest intact one is {intact}" if intact else ""
        raise FlowRLError(f"{ckpt}: damaged checkpoint ({problem}){hint}")
    return ckpt


def config_differences(ckpt: Path, cfg, prefixes=("model.", "train.lora.")) -> list[str]:
    """``key=saved (now current)`` for the model and LoRA settings that differ from the run that wrote ``ckpt``."""
    import yaml

    saved_path = Path(ckpt).parent.parent / "config.yaml"
    try:
        saved = yaml.safe_load(saved_path.read_text())
    except (OSError, yaml.YAMLError):
        return []

    def flat(d, prefix=""):
        out = {}
        for k, v in (d or {}).items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    from .config import to_dict

    a, b = flat(saved), flat(to_dict(cfg))
    return [f"{k}={a[k]!r} (this config: {b.get(k)!r})" for k in sorted(a)
            if k.startswith(prefixes) and k in b and a[k] != b[k]]


def _mismatch(ckpt: Path, cfg, detail: str) -> FlowRLError:
    diff = config_differences(ckpt, cfg) if cfg is not None else []
    why = f"it was written with {'; '.join(diff[:3])}" if diff else detail
    return FlowRLError(f"{ckpt}: its weights do not fit this model; {why}")


def lora_rank(ckpt_dir: Path) -> int | None:
    """The LoRA rank of a checkpoint's LoRA file, from its safetensors header alone (None: no LoRA file, or no
    lora_A tensor in it)."""
    path = Path(ckpt_dir) / LORA_FILE
    try:
        with open(path, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
    except (OSError, ValueError):
        return None
    ranks = [v["shape"][0] for k, v in header.items() if "lora_A" in k and isinstance(v, dict) and v.get("shape")]
    return ranks[0] if ranks else None


def checkpoint_is_lora(ckpt_dir: Path) -> bool:
    return bool(json.loads((Path(ckpt_dir) / "state.json").read_text()).get("lora", True))


def _sharded(module) -> bool:
    from .sharding import is_sharded

    return any(is_sharded(p) for p in module.parameters())


def _into_shards(module, state: dict[str, torch.Tensor]) -> None:
    """Whole tensors, read by every process, into a sharded (FSDP2) module: each process keeps its own shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True, strict=False))


def reference_checkpoints(paths: dict[str, str], lora: bool, owner: str) -> dict[str, Path]:
    """The checkpoints an algorithm's references load from (a teacher, an anchor; ``paths`` by reference name),
    found before any work: a missing one, or a LoRA one for a run that trains every weight (``lora`` false), is
    one line naming ``owner`` and saying what to give instead."""
    found = {name: find_checkpoint(path) for name, path in paths.items()}
    for name, ckpt in found.items():  # a teacher's layout must fit the student's weights
        if checkpoint_is_lora(ckpt) and not lora:
            raise ConfigError(f"{owner}: the reference {ckpt}{f' ({name})' if name else ''} "
                              "holds LoRA weights and this run trains every weight (train.lora.enabled=false); give a "
                              "full checkpoint, or train with LoRA of the teacher's layout")
    return found


def load_full_into(transformer, ckpt_dir: Path, cfg=None) -> None:
    """Full fine-tuning weights (safetensors from ``save_pretrained``, or a sharded run's shards) into a
    transformer of the same config, plain or sharded (every process of a sharded job calls it)."""
    from .sharded_checkpoint import is_sharded_checkpoint, load_sharded_weights

    if is_sharded_checkpoint(ckpt_dir):
        load_sharded_weights(transformer, ckpt_dir)
        return
    files = sorted((Path(ckpt_dir) / "transformer").glob("*.safetensors"))
    if not files:
        raise FlowRLError(f"{ckpt_dir}: no transformer weights (transformer/*.safetensors); is it a LoRA checkpoint?")
    sd = {}
    for f in files:
        sd.update(load_file(str(f)))
    own = transformer.state_dict()
    wrong = [k for k in sd if k in own and own[k].shape != sd[k].shape]
    missing, unexpected = sorted(set(own) - set(sd)), sorted(set(sd) - set(own))
    if wrong or missing or unexpected:
        first = (wrong or missing or unexpected)[0]
        raise _mismatch(ckpt_dir, cfg, f"first differing tensor {first}")
    if _sharded(transformer):
        _into_shards(transformer, sd)
    else:
        transformer.load_state_dict(sd)


def load_lora_into(transformer, ckpt_dir: Path, cfg=None) -> None:
    """Load a diffusers-format LoRA file into a transformer that already has the same adapter config, plain or
    sharded (every process of a sharded job calls it); every LoRA tensor of the model must come from the file,
    with its shape."""
    from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

    path = Path(ckpt_dir) / LORA_FILE
    if not path.is_file():
        raise FlowRLError(f"{ckpt_dir}: no {LORA_FILE}; is this a full fine-tuning checkpoint?")
    try:
        sd = load_file(str(path))
    except Exception as exc:
        raise FlowRLError(f"{path}: unreadable safetensors file ({exc})") from exc
    sd = {k.removeprefix("transformer."): v for k, v in sd.items()}
    own = get_peft_model_state_dict(transformer)
    wrong = [k for k in sd if k in own and own[k].shape != sd[k].shape]
    if wrong or set(own) != set(sd):
        first = (wrong or sorted(set(own) ^ set(sd)))[0]
        raise _mismatch(ckpt_dir, cfg, f"first differing LoRA tensor {first}; check train.lora rank and targets")
    set_peft_model_state_dict(transformer, sd)  # sharded too: peft cuts whole tensors into DTensor parameters


def load_trainer_state(ckpt_dir: Path) -> dict:
    path = Path(ckpt_dir) / STATE_FILE
    if not path.is_file():
        raise FlowRLError(f"{ckpt_dir}: no {STATE_FILE}; cannot resume from it")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise FlowRLError(f"{path}: unreadable trainer state ({type(exc).__name__}: {str(exc).splitlines()[0]})") from exc


def resume_checkpoint(cfg, run_dir, world: int) -> Path | None:
    """The checkpoint a run continues from (``resume``), checked against this launch's ``world`` processes before
    any model loads; None on a new run."""
    from .sharded_checkpoint import check_resume

    if not cfg.resume:
        return None
    ckpt = find_resume_checkpoint(cfg, run_dir)
    if ckpt is not None:
        check_resume(ckpt, cfg, world)
    return ckpt


def find_resume_checkpoint(cfg, run_dir=None) -> Path:
    """The checkpoint ``resume`` names: ``latest`` (the newest intact one of the run folder ``run_dir`` or
    log.output_dir / log.run_name) or a checkpoint folder."""
    from .errors import ConfigError

    if cfg.resume == "latest":
        base = Path(run_dir) if run_dir else (Path(cfg.log.output_dir) / cfg.log.run_name if cfg.log.run_name else None)
        if base is None:
            raise ConfigError("resume=latest needs log.run_name (the run to continue)")
        ckpt = latest_checkpoint(base)
        if ckpt is None:
            raise ConfigError(f"resume=latest: no intact checkpoint under {base}/checkpoints")
        return ckpt
    try:
        return find_checkpoint(cfg.resume)
    except FlowRLError as exc:
        raise ConfigError(f"resume: {exc}") from exc


def load_run_state(ckpt: Path, policy, algorithm, cfg) -> None:
    """Everything a resumed run continues from: the weights, optimizer, EMA and old-policy copies into ``policy``
    and the algorithm's own state (trackers, curricula)."""
    if policy.sharded:
        from .sharded_checkpoint import load_sharded_state

        info = load_sharded_state(ckpt, policy)
        algorithm.load_state_dict(info.get("algorithm_state", {}))
        return
    (load_lora_into if cfg.train.lora.enabled else load_full_into)(policy.module, ckpt, cfg)
    state = load_trainer_state(ckpt)
    try:
        policy.optimizer.load_state_dict(state["optimizer"])
    except (ValueError, KeyError, RuntimeError) as exc:
        raise FlowRLError(f"{ckpt}: its optimizer state does not fit this model ({str(exc).splitlines()[0]}); "
                          "resume with the run's own config.yaml") from exc
    if policy.ema is not None and "ema" in state:
        policy.ema.load_state_dict(state["ema"])
    if policy.old is not None and "old_policy" in state:
        policy.old = [t.to(p.device) for t, p in zip(state["old_policy"], policy.params)]
    algorithm.load_state_dict(json.loads((ckpt / "state.json").read_text()).get("algorithm_state", {}))
