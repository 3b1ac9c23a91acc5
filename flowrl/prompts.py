"""Prompt sources: a fixed list or a file, sampled deterministically per iteration."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .errors import ConfigError

DEFAULT_TINY_PROMPTS = [
    "a red circle on a blue background",
    "a green square on a white background",
    "a yellow triangle on a black background",
    "a blue cross on a yellow background",
    "a white circle on a red background",
    "a black square on a green background",
    "a purple triangle on an orange background",
    "an orange cross on a purple background",
]


def prompt_set(name: str) -> list[str]:
    """A registered prompt set (``flowrl.registry.PROMPT_SETS``) or ``module:function`` returning prompts."""
    from .registry import PROMPT_SETS, resolve

    return list(resolve(PROMPT_SETS, name, "data.prompt_set")())


def read_prompt_file(path: str | Path) -> tuple[list[str], list[dict]]:
    """.txt: one prompt per line; .jsonl: objects with a 'prompt' field (the rest is metadata)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"data.prompt_file: file not found: {path}")
    prompts, meta = [], []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}); save the prompt file as UTF-8") from exc
    if path.suffix == ".jsonl":
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{n}: not valid JSON ({exc.msg})") from exc
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise ConfigError(f"{path}:{n}: each line must be an object with a string 'prompt' field")
            prompts.append(obj["prompt"])
            meta.append({k: v for k, v in obj.items() if k != "prompt"})
    else:
        prompts = [line.strip() for line in text.splitlines() if line.strip()]
        meta = [{} for _ in prompts]
    return prompts, meta


class PromptSource:
    """Yields ``n`` prompts per iteration: walks seeded permutations (epochs) of the prompt list, so that an
    iteration's prompts depend only on (seed, iteration) and resume is exact."""

    def __init__(self, prompts: list[str], metadata: list[dict] | None = None, seed: int = 0):
        if not prompts:
            raise ConfigError("data.prompts: the prompt list is empty; give data.prompts or data.prompt_file")
        if any(not isinstance(p, str) or not p.strip() for p in prompts):
            raise ConfigError("data.prompts: every prompt must be a non-empty string")
        self.prompts = list(prompts)
        self.metadata = metadata or [{} for _ in prompts]
        self.seed = seed

    @classmethod
    def from_config(cls, data_cfg, seed: int, model_cfg=None) -> "PromptSource":
        """data.prompt_set, data.prompt_file or data.prompts; a randomly initialised tiny model with none of them
        gets a few short demo prompts, so `flowrl train` runs with no arguments."""
        default = DEFAULT_TINY_PROMPTS if model_cfg is not None and model_cfg.pretrained in (None, "", "tiny") else None
        if data_cfg.prompt_set != "none":
            return cls(prompt_set(data_cfg.prompt_set), None, seed)
        if data_cfg.prompt_file:
            prompts, meta = read_prompt_file(data_cfg.prompt_file)
            if not prompts:
                raise ConfigError(f"data.prompt_file: {data_cfg.prompt_file} holds no prompts")
            return cls(prompts, meta, seed)
        prompts = data_cfg.prompts or (default or [])
        return cls(prompts, None, seed)

    def _perm(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
        return torch.randperm(len(self.prompts), generator=g).tolist()

    def batch(self, iteration: int, n: int) -> tuple[list[str], list[dict]]:
        size = len(self.prompts)
        out = []
        for k in range(iteration * n, iteration * n + n):
            out.append(self._perm(k // size)[k % size])
        return [self.prompts[i] for i in out], [self.metadata[i] for i in out]
