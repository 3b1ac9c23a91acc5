"""The embedded tiny video model (``model.pretrained: tiny-moving-shapes``): a pixel-space Wan 2.1-architecture
transformer and a tiny UMT5 encoder, built from its fixed config or loaded from the package's assets."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import FlowRLError
from ..resources import assets_dir
from .moving import FRAMES, RESOLUTION

# The embedded video model's fixed architecture (pretrained by `flowrl pretrain-tiny-video`): pixel space, 4 frames
# of 20 px, 4x4-pixel patches (25 tokens per frame, 100 per clip), 4 blocks of 3 heads x 64.
MOVING_SHAPES_TINY = {"patch_size": (1, 4, 4), "num_attention_heads": 3, "attention_head_dim": 64, "ffn_dim": 512,
                      "num_layers": 4, "text_dim": 64, "text_layers": 2, "max_tokens": 16}


def build_moving_shapes_tokenizer():
    """A word-level tokenizer over the domain's vocabulary in which "<colour> background" is one token: the shape's
    and the background's colours are different tokens, so the tiny encoder need not learn word roles from
    relative positions (UMT5 has no absolute ones; a first version with shared colour tokens drew the two colours
    in swapped roles half the time). Deterministic, built offline."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from .domain import COLORS, SHAPES
    from .moving import DIRECTIONS

    words = ["<pad>", "</s>", "<unk>", "a", "an", "moving", "on", *COLORS, *SHAPES, *DIRECTIONS,
             *(f"{c} background" for c in COLORS)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\s+(?!background)"), behavior="removed")  # keeps "<c> background"
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def build_tiny_moving_shapes_pipeline(seed: int = 0, patch_size: tuple[int, int, int] | None = None):
    """The embedded video model's architecture, randomly initialised: a pixel-space (no VAE) Wan 2.1 transformer
    and a tiny UMT5 encoder with the domain tokenizer; flow-matching scheduler with shift 1."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    c = MOVING_SHAPES_TINY
    torch.manual_seed(seed)
    tokenizer = build_moving_shapes_tokenizer()
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), d_model=c["text_dim"], d_kv=16,
                                               d_ff=2 * c["text_dim"], num_layers=c["text_layers"], num_heads=4,
                                               pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                               decoder_start_token_id=tokenizer.pad_token_id))
    transformer = WanTransformer3DModel(
        patch_size=tuple(patch_size or c["patch_size"]), num_attention_heads=c["num_attention_heads"],
        attention_head_dim=c["attention_head_dim"], in_channels=3, out_channels=3, text_dim=c["text_dim"],
        freq_dim=64, ffn_dim=c["ffn_dim"], num_layers=c["num_layers"], rope_max_seq_len=64)
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=None,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0), transformer=transformer)


def load_tiny_moving_shapes_pipeline(path: str | Path | None = None):
    """The shipped pretrained tiny video model (or a folder written by ``flowrl pretrain-tiny-video --export-dir``)
    as a pixel-space WanPipeline (fp32), its tokenizer rebuilt offline."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5EncoderModel

    path = Path(path) if path else assets_dir() / "tiny_moving_shapes"
    if not (path / "transformer" / "config.json").is_file():
        raise FlowRLError(f"the pretrained tiny video model is missing at {path}; run `flowrl pretrain-tiny-video` "
                          "to rebuild it")
    kw = {"torch_dtype": torch.float32}
    # A Wan 2.2-style export has a low-noise expert (transformer_2) and the boundary in model_index.json
    second, boundary = None, None
    if (path / "transformer_2" / "config.json").is_file():
        second = WanTransformer3DModel.from_pretrained(str(path / "transformer_2"), **kw)
        boundary = json.loads((path / "model_index.json").read_text())["boundary_ratio"]
    pipe = WanPipeline(
        tokenizer=build_moving_shapes_tokenizer(),
        text_encoder=UMT5EncoderModel.from_pretrained(str(path / "text_encoder"), **kw), vae=None,
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(str(path / "scheduler")),
        transformer=WanTransformer3DModel.from_pretrained(str(path / "transformer"), **kw), transformer_2=second,
        boundary_ratio=boundary)
    pipe.embedded_geometry = {"resolution": RESOLUTION, "num_frames": FRAMES}
    pipe.embedded_max_tokens = MOVING_SHAPES_TINY["max_tokens"]
    return pipe
