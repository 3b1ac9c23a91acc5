"""Prompt sources: a fixed list or a file, sampled deterministically per iteration."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch

from .editing import edit_prompt_from_row, remember_image, source_scheme
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


def prompt_set(name: str, key: str = "data.prompt_set") -> list[str]:
    """A registered prompt set (``flowrl.registry.PROMPT_SETS``) or ``module:function`` returning prompts; ``key``
    names the config key in messages."""
    from .errors import ConfigError
    from .registry import PROMPT_SETS

    if name not in PROMPT_SETS and ":" not in name:
        import difflib

        known = PROMPT_SETS.names()
        close = difflib.get_close_matches(name, known, n=1)
        raise ConfigError(f"{key}: unknown prompt set {name!r}" + (f"; did you mean {close[0]!r}?" if close else "")
                          + f" (known: {', '.join(known)}; or module:function)")

    try:
        prompts = PROMPT_SETS.resolve(name)()
    except ConfigError:
        raise
    except Exception as exc:  # a user's prompt-set function that fails: named, one line
        raise ConfigError(f"{key}: {name!r} failed: {type(exc).__name__}: {str(exc)[:200]}") from exc
    if isinstance(prompts, str) or not all(isinstance(p, str) for p in (prompts or [None])):
        raise ConfigError(f"{key}: {name!r} returned {type(prompts).__name__}, not a list of prompt strings")
    return list(prompts)


SOURCE_FIELDS = ("source", "sources")  # a data row's source image(s): the row is an edit request
PATH_FIELDS = (*SOURCE_FIELDS, "mask")  # image paths a prompt file's rows give relative to its folder


def _beside(path: Path, value):
    """Source keys relative to the prompt file's folder (schemes and absolute paths as they are)."""
    if isinstance(value, str):
        return value if source_scheme(value) or Path(value).is_absolute() else str(path.parent / value)
    return [_beside(path, v) for v in value] if isinstance(value, list) else value


def read_prompt_file(path: str | Path) -> tuple[list[str], list[dict]]:
    """.txt: one prompt per line; .jsonl: objects with a 'prompt' field (the rest is metadata). A row with a
    ``source`` (an image path, relative to the file's folder) or ``sources`` (a list) is an edit request
    (:class:`flowrl.editing.EditPrompt`)."""
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
            # a relative source path is read from the prompt file's folder
            obj = {k: (_beside(path, v) if k in PATH_FIELDS else v) for k, v in obj.items()}
            prompts.append(edit_prompt_from_row(obj["prompt"], obj, f"{path}:{n}"))
            meta.append({k: v for k, v in obj.items() if k != "prompt" and k not in SOURCE_FIELDS})
    else:
        prompts = [line.strip() for line in text.splitlines() if line.strip()]
        meta = [{} for _ in prompts]
    return prompts, meta


DATASET_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv", ".arrow": "arrow"}


def read_dataset(name: str, split: str = "train", prompt_column: str = "prompt",
                 metadata_columns: list[str] | None = None) -> tuple[list[str], list[dict]]:
    """Prompts and their metadata from a Hugging Face dataset.

    Args:
        name: a local data file (.parquet, .jsonl, .json, .csv, .arrow), a local folder (written by
            ``Dataset.save_to_disk``, or holding data files), or a hub id (read only when the hub is reachable).
        split: the split to read (a single data file is its ``train`` split).
        prompt_column: the column with the prompts.
        metadata_columns: the columns kept as metadata; None or empty: every other column.
    Returns:
        ``(prompts, metadata)``: N strings and N dicts.
    """
    import datasets

    with _quiet_datasets():  # its own log lines and bars would add to the one line an error gets
        return _read_dataset(datasets, name, split, prompt_column, metadata_columns)


@contextmanager
def _quiet_datasets():
    import logging

    from datasets.utils import logging as ds_logging

    logger = logging.getLogger("datasets")
    level, bars = logger.level, ds_logging.is_progress_bar_enabled()
    logger.setLevel(logging.CRITICAL)
    ds_logging.disable_progress_bar()
    try:
        yield
    finally:
        logger.setLevel(level)
        if bars:
            ds_logging.enable_progress_bar()


def _read_dataset(datasets, name: str, split: str, prompt_column: str, metadata_columns) -> tuple[list[str], list[dict]]:
    path = Path(name)
    try:
        if path.is_file() and path.stat().st_size == 0:
            raise ConfigError(f"data.dataset: {path} is empty; give a file with a {prompt_column!r} column")
        if path.is_file():
            builder = DATASET_BUILDERS.get(path.suffix)
            if builder is None:
                raise ConfigError(f"data.dataset: {path.suffix} files are not read; use one of "
                                  f"{', '.join(DATASET_BUILDERS)}")
            table = datasets.load_dataset(builder, data_files={split: str(path)}, split=split)
        elif path.is_dir() and (path / "dataset_info.json").is_file():
            table = datasets.load_from_disk(str(path))
        elif path.is_dir() and (path / "dataset_dict.json").is_file():
            table = datasets.load_from_disk(str(path))[split]
        else:
            table = datasets.load_dataset(str(path) if path.is_dir() else name, split=split)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 (datasets wraps a reader's error in its own; the cause says what is wrong)
        cause = exc
        while type(cause).__name__ == "DatasetGenerationError" and cause.__cause__ is not None:
            cause = cause.__cause__
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise ConfigError(f"data.dataset: cannot read {name!r} split {split!r} ({type(cause).__name__}: "
                          f"{first[:300]})") from exc
    columns = list(table.column_names)
    if prompt_column not in columns:
        raise ConfigError(f"data.prompt_column: {name} has no column {prompt_column!r} (its columns: "
                          f"{', '.join(columns)})")
    keep = list(metadata_columns or [c for c in columns if c != prompt_column and c not in SOURCE_FIELDS])
    missing = [c for c in keep if c not in columns]
    if missing:
        raise ConfigError(f"data.metadata_columns: {name} has no column {missing[0]!r} (its columns: "
                          f"{', '.join(columns)})")
    prompts = table[prompt_column]
    if any(not isinstance(p, str) or not p.strip() for p in prompts):
        raise ConfigError(f"data.dataset: every {prompt_column!r} must be a non-empty string in {name}")
    meta_columns = {c: table[c] for c in keep}
    metadata = [{c: meta_columns[c][i] for c in keep} for i in range(len(prompts))]
    source_column = next((c for c in SOURCE_FIELDS if c in columns), None)
    if source_column is None:
        return list(prompts), metadata
    # an image column holds decoded images (kept in memory under a digest key); a string column holds paths
    where = f"data.dataset {name} column {source_column!r}"
    requests = []
    for i, (p, given) in enumerate(zip(prompts, table[source_column])):
        keys = given if isinstance(given, list) else [given]
        keys = [remember_image(k) if hasattr(k, "convert") else k for k in keys]
        if path.is_file() or path.is_dir():  # a relative path is read beside the local dataset, as documented
            anchor = path if path.is_file() else path / "_"
            keys = [_beside(anchor, k) if isinstance(k, str) else k for k in keys]
        requests.append(edit_prompt_from_row(p, {"sources": keys}, f"{where} row {i}"))
    return requests, metadata


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
        """data.prompt_set, data.dataset, data.prompt_file or data.prompts; a randomly initialised tiny model with none of them
        gets a few short demo prompts, so `flowrl train` runs with no arguments."""
        default = DEFAULT_TINY_PROMPTS if model_cfg is not None and model_cfg.pretrained in (None, "", "tiny") else None
        if data_cfg.prompt_set != "none":
            return cls(prompt_set(data_cfg.prompt_set), None, seed)
        if data_cfg.dataset:
            prompts, meta = read_dataset(data_cfg.dataset, data_cfg.split, data_cfg.prompt_column,
                                         data_cfg.metadata_columns)
            if not prompts:
                raise ConfigError(f"data.dataset: {data_cfg.dataset} split {data_cfg.split!r} holds no prompts")
            return cls(prompts, meta, seed)
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
