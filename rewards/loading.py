"""Finding and loading reward-model weights: local paths first, the Hugging Face hub only when reachable.

Every loader ends in one clear line when the weights are missing (which file, from which repository, where to
put it) and loads only safetensors or ``torch.load(weights_only=True)``. Official checkpoints are loaded
unchanged: a ``{'state_dict': ...}`` wrapper and a ``module.`` prefix are accepted, and the key set must
match the model exactly (``load_strict`` names the first missing and unexpected keys otherwise).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from flowrl.errors import RewardError


def hub_offline() -> bool:
    """True when the user asked for no network (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE / FLOWRL_OFFLINE)."""
    return any(os.environ.get(k, "").lower() in ("1", "true", "yes", "on")
               for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "FLOWRL_OFFLINE"))


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub (``HF_ENDPOINT``) accepts a connection within ``timeout`` seconds: checked
    before a download, so that a machine without a network is told at once instead of after the hub client's
    retries (minutes)."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "huggingface.co", port), timeout=timeout):
            return True
    except OSError:
        return False


def _looks_like_repo_id(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and not Path(name).exists()


def resolve_file(reward: str, path: str | None, repo_id: str, filename: str, how: str = "") -> Path:
    """A weights file: ``path`` (a file, or a folder holding ``filename``) when given, else ``filename`` from the
    hub repository ``repo_id`` (the local cache first; a download only when the hub is allowed)."""
    if path:
        p = Path(path).expanduser()
        if p.is_dir():
            p = p / filename
        if p.is_file():
            return p
        raise RewardError(f"{reward}: {p} not found; it should be {filename} from the Hugging Face repository "
                          f"{repo_id}{how}")
    try:
        from huggingface_hub import hf_hub_download
    except ImportError as exc:  # pragma: no cover - huggingface_hub comes with transformers
        raise RewardError(f"{reward}: give path= to {filename} (huggingface_hub is not installed)") from exc
    try:
        return Path(hf_hub_download(repo_id, filename, local_files_only=True))
    except Exception:
        pass
    if hub_offline():
        raise RewardError(f"{reward}: needs {filename} from the Hugging Face repository {repo_id}, which is not in the "
                          f"local cache and the hub is off (HF_HUB_OFFLINE); download it where the hub is reachable "
                          f"(`hf download {repo_id} {filename}`) and pass path=/folder/or/file{how}")
    try:
        return Path(hf_hub_download(repo_id, filename))
    except Exception as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise RewardError(f"{reward}: could not get {filename} from the Hugging Face repository {repo_id} ({reason}); "
                          f"download it where the hub is reachable and pass path=/folder/or/file{how}") from exc


def resolve_pretrained_dir(reward: str, name_or_path: str, needed: str = "config.json and model.safetensors") -> str:
    """A transformers ``from_pretrained`` argument: a local folder as is, a hub id from the cache or the hub."""
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        return str(p)
    if not _looks_like_repo_id(name_or_path):
        raise RewardError(f"{reward}: {name_or_path} is neither a local folder nor a Hugging Face repository id")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name_or_path, local_files_only=True)
    except Exception:
        pass
    if hub_offline() or not hub_reachable():
        why = "the hub is off (HF_HUB_OFFLINE)" if hub_offline() else "the hub cannot be reached from this machine"
        raise RewardError(f"{reward}: needs the Hugging Face repository {name_or_path} ({needed}), which is not in the "
                          f"local cache and {why}; download it where the hub is reachable "
                          f"(`hf download {name_or_path}`) and pass its local folder instead")
    return name_or_path  # from_pretrained downloads it; its own error names the repository


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """A state dict from .safetensors or a torch pickle (weights_only), unwrapped from ``{'state_dict': ...}`` or
    ``{'model': ...}`` and stripped of a DataParallel ``module.`` prefix."""
    path = Path(path)
    if not path.is_file():
        raise RewardError(f"{path}: file not found")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise RewardError(f"{path}: unreadable checkpoint ({reason}); expected safetensors or a torch state dict "
                          "loadable with weights_only=True") from exc
    for wrapper in ("state_dict", "model"):  # {'state_dict': ...} (Lightning), {'model': ...} (trainers' saves)
        if isinstance(state, dict) and wrapper in state and isinstance(state[wrapper], dict):
            state = state[wrapper]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise RewardError(f"{path}: not a state dict (a mapping of names to tensors)")
    if state and all(k.startswith("module.") for k in state):
        state = {k[len("module."):]: v for k, v in state.items()}
    return state


def load_strict(module: torch.nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Copy ``state`` into ``module`` (any dtype -> the module's), failing with the first missing / unexpected keys
    and shape mismatches."""
    own = module.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing keys (first: {', '.join(missing[:4])})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected keys (first: {', '.join(unexpected[:4])})")
        raise RewardError(f"{source}: does not match the {type(module).__name__} layout: {'; '.join(parts)}")
    wrong = [f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}" for k, v in own.items() if state[k].shape != v.shape]
    if wrong:
        raise RewardError(f"{source}: {len(wrong)} tensors have the wrong shape (first: {wrong[0]}); "
                          "was it made for another model size?")
    module.load_state_dict(state, strict=True)


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """(N, 3, H, W) float in [0, 1] -> uint8, quantised as the reference trainers do (round, clamp)."""
    return (images.detach().float().cpu() * 255).round().clamp(0, 255).to(torch.uint8)


def to_pil(images: torch.Tensor) -> list:
    """(N, 3, H, W) float in [0, 1] -> RGB PIL images (the references' uint8 path)."""
    from PIL import Image

    return [Image.fromarray(x.permute(1, 2, 0).numpy()) for x in to_uint8(images)]


def check_images(reward: str, images: torch.Tensor) -> None:
    if not isinstance(images, torch.Tensor) or images.dim() != 4 or images.shape[1] != 3:
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise RewardError(f"{reward}: images must be a float tensor (N, 3, H, W) in [0, 1], got {shape}")
