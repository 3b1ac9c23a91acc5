"""The CLIP tokenizer built offline from open_clip's bundled BPE file gives open_clip's ids."""

import hashlib
import html
import json
import re
from pathlib import Path

import pytest

from flowrl.tokenizer import build_clip_tokenizer, clip_vocab_and_merges


def write_clip_tokenizer_files(directory) -> Path:
    """``vocab.json`` and ``merges.txt`` in the openai layout, to compare bytes with the published files."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab, merges = clip_vocab_and_merges()
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False, separators=(",", ":")), encoding="utf-8")
    (directory / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n", encoding="utf-8")
    return directory


def open_clip_clean(text: str) -> str:
    """open_clip's default cleaning (ftfy, HTML unescape twice, whitespace collapse, lowercase)."""
    import ftfy

    text = html.unescape(html.unescape(ftfy.fix_text(text)))
    return re.sub(r"\s+", " ", text).strip().lower()


PROMPTS = [
    "a red circle on a blue background",
    "A photo of an astronaut riding a horse, 4k, highly detailed!!!",
    "it's a dog's life; they're here & we'll see",
    "café crème brûlée",
    "numbers 12345 and symbols #@$%^",
    "don’t “quote” me",  # curly quotes: open_clip's ftfy uncurls them
    "fish &amp; chips",  # HTML entity
    "ＡＢＣ fullwidth",
    " ".join(["word"] * 100),  # longer than 77 tokens
]


def test_vocab_layout():
    vocab, merges = clip_vocab_and_merges()
    assert len(vocab) == 49408 and len(merges) == 48894
    assert vocab["<|startoftext|>"] == 49406 and vocab["<|endoftext|>"] == 49407
    assert vocab["!"] == 0 and vocab["!</w>"] == 256


def test_merges_file_matches_openai_bytes(tmp_path):
    write_clip_tokenizer_files(tmp_path)
    data = (tmp_path / "merges.txt").read_bytes()
    assert len(data) == 524619
    assert hashlib.sha256(data).hexdigest() == "9fd691f7c8039210e0fced15865466c65820d09b63988b0174bfe25de299051a"


@pytest.mark.parametrize("prompt", PROMPTS)
def test_ids_equal_open_clip(prompt):
    import open_clip

    ref = open_clip.get_tokenizer("ViT-B-32")([prompt])[0].tolist()
    tok = build_clip_tokenizer(77)
    ours = tok(open_clip_clean(prompt), padding="max_length", max_length=77, truncation=True).input_ids
    # open_clip pads with 0, transformers with <|endoftext|>; compare up to the first end token
    end = ref.index(49407) + 1
    assert ours[:end] == ref[:end]
    assert len(ours) == 77
