"""Image editing requests: an instruction with the source images it edits.

An :class:`EditPrompt` is a ``str`` (the instruction: what the text encoder reads, what logs and grids show) that
also carries ``sources``, the keys of its source images. Everything that handles prompts (prompt sources, the
per-prompt embedding cache, group advantages, trackers, rewards) handles an edit request unchanged, and two requests
with the same instruction and different sources stay two prompts. An editing family reads the sources when it encodes
the prompt and puts the reference conditioning beside the text embeddings, so the tree engine, the algorithms and
the update need no special case.

A source key is a path to an image file, or ``scheme:spec`` for an image a registered renderer draws
(``flowrl.registry.SOURCE_SCHEMES``: ``shapes:`` draws the shapes domain's captions).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from .errors import ConfigError


class EditPrompt(str):
    """An instruction (the string's value) with the keys of its source images (``sources``, one or more)."""

    sources: tuple[str, ...]

    def __new__(cls, instruction: str, sources):
        if isinstance(sources, str):
            sources = (sources,)
        sources = tuple(str(s) for s in sources)
        if not sources:
            raise ConfigError(f"edit request {instruction!r}: give at least one source image")
        obj = super().__new__(cls, instruction)
        obj.sources = sources
        return obj

    @property
    def instruction(self) -> str:
        return str.__str__(self)

    # equal only to a request with the same instruction and the same sources: the embedding cache and the
    # per-prompt trackers keep two sources of one instruction apart
    def __eq__(self, other):
        return isinstance(other, EditPrompt) and str.__eq__(self, other) and self.sources == other.sources

    def __ne__(self, other):
        return not self.__eq__(other)

    def __hash__(self):
        return hash((str.__str__(self), self.sources))

    def __reduce__(self):  # pickling (processes, checkpoints) keeps the sources
        return (EditPrompt, (str.__str__(self), self.sources))

    def __repr__(self):
        return f"EditPrompt({str.__str__(self)!r}, sources={self.sources!r})"


def sources_of(prompt: str) -> tuple[str, ...]:
    """The source keys of a prompt (empty for a plain text prompt)."""
    return prompt.sources if isinstance(prompt, EditPrompt) else ()


def edit_prompt_from_row(prompt: str, row: dict, where: str) -> str:
    """A data row's prompt as an :class:`EditPrompt` when the row names a source (``source``: one key, or ``sources``:
    a list), else the plain prompt; the ``source`` / ``sources`` fields leave the row's metadata (the caller drops
    them). File sources are checked here, so a missing image stops the run before any work."""
    given = row.get("sources", row.get("source"))
    if given is None:
        return prompt
    keys = [given] if isinstance(given, str) else given
    if not isinstance(keys, (list, tuple)) or not keys or not all(isinstance(k, str) and k for k in keys):
        raise ConfigError(f"{where}: 'source' must be an image path (or 'sources' a list of them)")
    for key in keys:
        check_source(key, where)
    return EditPrompt(prompt, keys)


def check_source(key: str, where: str) -> None:
    """One line if ``key`` names no readable image (a missing or unreadable file, an unknown scheme)."""
    scheme = source_scheme(key)
    if scheme == "memory":
        if key not in _IN_MEMORY:
            raise ConfigError(f"{where}: {key} names no image this process has read")
        return
    if scheme is not None:
        from .registry import SOURCE_SCHEMES

        SOURCE_SCHEMES.resolve(scheme)
        return
    path = Path(key)
    if not path.is_file():
        raise ConfigError(f"{where}: source image not found: {key}")
    try:
        from PIL import Image

        with Image.open(path) as img:
            img.load()  # the whole file: a truncated one fails here (its header alone would pass)
    except Exception as exc:  # PIL raises several types for a file it cannot read
        why = str(exc).strip().splitlines()[0][:80] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{where}: cannot read source image {key} ({why}); give a whole PNG, JPEG or WebP "
                          "file") from exc


# images a dataset's image column decoded, by their digest key ("memory:<sha256 of the pixels>")
_IN_MEMORY: dict[str, object] = {}


def remember_image(image) -> str:
    """Keep a decoded PIL image (a dataset's image column) and return its source key."""
    import hashlib

    rgb = image.convert("RGB")
    key = "memory:" + hashlib.sha256(rgb.tobytes() + repr(rgb.size).encode()).hexdigest()[:32]
    _IN_MEMORY[key] = rgb
    return key


def source_scheme(key: str) -> str | None:
    """The scheme of a ``scheme:spec`` source key (``shapes``, ``memory``), or None for a path."""
    head, sep, _ = key.partition(":")
    # a Windows drive letter (C:\...) is a path, not a scheme
    return head if sep and len(head) > 1 and head.isidentifier() else None


def load_source(key: str, size: int):
    """The source image ``key`` as an RGB PIL image of ``size`` x ``size`` pixels (a file resized with Lanczos, as
    diffusers' image processors resize; a scheme's renderer draws at that size)."""
    return _load_source(key, size).copy()


@lru_cache(maxsize=512)
def _load_source(key: str, size: int):
    from PIL import Image

    scheme = source_scheme(key)
    if scheme == "memory":
        check_source(key, "source image")
        image = _IN_MEMORY[key]
    elif scheme is not None:
        from .registry import SOURCE_SCHEMES

        image = SOURCE_SCHEMES.resolve(scheme)(key[len(scheme) + 1:], size)
    else:
        check_source(key, "source image")
        with Image.open(key) as img:
            image = img.convert("RGB")
    if image.size != (size, size):
        image = image.resize((size, size), resample=Image.LANCZOS)
    return image


def source_tensor(prompts: list[str], size: int, index: int = 0):
    """(N, 3, size, size) float images in [0, 1]: each prompt's ``index``-th source (rewards compare results with
    them). A prompt without sources is an error that names it."""
    import numpy as np
    import torch

    rows = []
    for p in prompts:
        keys = sources_of(p)
        if len(keys) <= index:
            raise ConfigError(f"prompt {str(p)!r} has no source image {index}; editing rewards need data rows with "
                              "a 'source' field")
        rows.append(torch.from_numpy(np.asarray(load_source(keys[index], size), dtype=np.float32) / 255.0))
    return torch.stack(rows).permute(0, 3, 1, 2)


def check_prompts_fit(cfg, prompts: list[str]) -> None:
    """One line, before any work, where the prompts do not fit the family: an editing family (its adapter's
    ``edits``) needs every prompt to be an edit request, a text-to-image family takes none."""
    from .registry import adapter_class

    family = cfg.model.family
    edits = getattr(adapter_class(family), "edits", False)
    if edits:
        plain = next((p for p in prompts if not sources_of(p)), None)
        if plain is not None:
            raise ConfigError(f"model.family={family} edits images: the prompt {str(plain)!r} has no source image; give "
                              "data rows with a 'source' field (a data.prompt_file .jsonl, a data.dataset with a "
                              "'source' column, or data.prompt_set=shapes-edit-train)")
        if cfg.data.sample_prompts:
            raise ConfigError(f"data.sample_prompts: model.family={family} edits images and these prompts have no "
                              "source; leave data.sample_prompts empty (the grids edit the first training requests)")
    elif any(sources_of(p) for p in prompts):
        from .registry import MODEL_FAMILIES

        editing = [n for n in MODEL_FAMILIES.names() if getattr(MODEL_FAMILIES.resolve(n), "edits", False)]
        raise ConfigError(f"data: the prompts are edit requests with source images, but model.family={family} "
                          f"generates from text alone; use an editing family ({', '.join(editing)})")


def prepend_sources(images, prompts: list[str], per_prompt: int):
    """(P * (S + 1), 3, H, W): each prompt's S results (``images``, prompt-major) after its first source image, so a
    grid of rows of S + 1 reads source | results. Plain prompts are returned as they are."""
    import torch

    if not any(sources_of(p) for p in prompts):
        return images
    sources = source_tensor(prompts, images.shape[-1]).to(images)
    rows = images.view(len(prompts), per_prompt, *images.shape[1:])
    return torch.cat([sources[:, None], rows], dim=1).flatten(0, 1)
