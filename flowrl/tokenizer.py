"""The CLIP BPE tokenizer built offline from the vocabulary file that open_clip_torch ships.

Recipe: ids 0-255 are the byte alphabet in ``bytes_to_unicode`` order,
256-511 the same with ``</w>``, then one id per merge in file order, then ``<|startoftext|>`` (49406) and
``<|endoftext|>`` (49407). The result equals the openai CLIP tokenizer files byte for byte.
"""

from __future__ import annotations

import gzip
import os
from functools import lru_cache
from pathlib import Path

NUM_MERGES = 49152 - 256 - 2  # open_clip keeps lines[1 : 48895]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2 / CLIP reversible byte -> printable character map (insertion order matters for the ids)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def open_clip_bpe_path() -> str:
    """Path of open_clip's bundled ``bpe_simple_vocab_16e6.txt.gz``, found without importing open_clip."""
    import importlib.util

    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("building the CLIP tokenizer offline needs open_clip_torch: pip install open_clip_torch")
    path = Path(list(spec.submodule_search_locations)[0]) / "bpe_simple_vocab_16e6.txt.gz"
    if not path.is_file():
        raise RuntimeError(f"open_clip_torch is installed but its BPE file is missing: {path}")
    return str(path)


def _cache_dir() -> Path:
    root = os.environ.get("FLOWRL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "flowrl")
    return Path(root) / "clip_tokenizer"


@lru_cache(maxsize=1)
def clip_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    with gzip.open(open_clip_bpe_path(), "rt", encoding="utf-8") as fh:
        lines = fh.read().split("\n")
    merges = [tuple(line.split()) for line in lines[1 : NUM_MERGES + 1]]
    alphabet = list(bytes_to_unicode().values())
    tokens = alphabet + [a + "</w>" for a in alphabet] + ["".join(m) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return {t: i for i, t in enumerate(tokens)}, merges


def build_clip_tokenizer(model_max_length: int = 77):
    """A transformers ``CLIPTokenizer`` equal to openai's, built without network access.

    The first call parses the BPE file (a few seconds) and caches the fast-tokenizer JSON under
    ``$FLOWRL_CACHE`` (default ``~/.cache/flowrl``); later calls load that in well under a second.
    """
    from transformers import CLIPTokenizer

    cache = _cache_dir()
    if (cache / "tokenizer.json").is_file():
        try:
            return CLIPTokenizer.from_pretrained(str(cache), model_max_length=model_max_length)
        except Exception:  # a corrupt cache is rebuilt below
            pass
    vocab, merges = clip_vocab_and_merges()
    tok = CLIPTokenizer(vocab=dict(vocab), merges=list(merges), model_max_length=77)
    tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
    tok.save_pretrained(str(tmp))
    os.replace(tmp, cache) if not cache.exists() else None
    tok.model_max_length = model_max_length
    return tok
