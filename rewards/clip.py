"""CLIP score with open_clip backbones, including the tiny shapes CLIP that ships in ``assets/tiny_clip``.

score = cosine(image embedding, text embedding) by default (``convention="cosine"``); ``"clipscore"`` gives
``max(100 * cos, 0)`` (Hessel et al.). Images arrive as (N, 3, H, W) in [0, 1] and are resized (bicubic,
antialiased) to the model's input size and normalised with the OpenAI CLIP mean/std, as open_clip's
``preprocess_val`` does for square images.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from flowrl.errors import RewardError

from .registry import register_reward

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
TINY_CLIP_DIR = Path(__file__).resolve().parent.parent / "assets" / "tiny_clip"


def tiny_clip_config() -> dict:
    """An open_clip model config at tiny size for 32 px shapes images (``open_clip.add_model_config`` format)."""
    return {
        "embed_dim": 64,
        "vision_cfg": {"image_size": 32, "layers": 4, "width": 128, "patch_size": 4, "head_width": 32},
        "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
    }


def build_open_clip(config: dict):
    import open_clip

    from open_clip.model import CLIP

    return CLIP(embed_dim=config["embed_dim"], vision_cfg=open_clip.model.CLIPVisionCfg(**config["vision_cfg"]),
                text_cfg=open_clip.model.CLIPTextCfg(**config["text_cfg"]))


def load_tiny_clip(path: str | Path | None = None):
    """(model, tokenizer) of the shipped tiny shapes CLIP (open_clip architecture, safetensors weights)."""
    import open_clip
    from safetensors.torch import load_file

    path = Path(path) if path else TINY_CLIP_DIR
    cfg_path, weights = path / "open_clip_config.json", path / "open_clip_model.safetensors"
    if not cfg_path.is_file() or not weights.is_file():
        raise RewardError(f"tiny CLIP missing at {path} (need open_clip_config.json and open_clip_model.safetensors); "
                          "rebuild it with `flowrl pretrain-tiny-clip`")
    config = json.loads(cfg_path.read_text())["model_cfg"]
    model = build_open_clip(config)
    state = {k: v.float() for k, v in load_file(str(weights)).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RewardError(f"{weights}: keys do not match the config (missing {missing[:3]}, unexpected {unexpected[:3]})")
    tokenizer = open_clip.tokenizer.SimpleTokenizer(context_length=config["text_cfg"]["context_length"])
    return model.eval(), tokenizer


def preprocess(images: torch.Tensor, size: int) -> torch.Tensor:
    """(N, 3, H, W) in [0, 1] -> normalised (N, 3, size, size)."""
    x = images.float()
    if x.shape[-1] != size or x.shape[-2] != size:
        x = torch.nn.functional.interpolate(x, size=(size, size), mode="bicubic", align_corners=False, antialias=True)
    mean = torch.tensor(OPENAI_MEAN, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(OPENAI_STD, device=x.device).view(1, 3, 1, 1)
    return (x.clamp(0, 1) - mean) / std


@register_reward("clip")
class ClipScore:
    """CLIP score. ``model="tiny-shapes"`` (default) uses the shipped tiny CLIP; otherwise an open_clip model
    name with ``pretrained`` (a tag the user's machine can download, or a local checkpoint path)."""

    def __init__(self, model: str = "tiny-shapes", pretrained: str | None = None, convention: str = "cosine",
                 device: str = "cpu"):
        if convention not in ("cosine", "clipscore"):
            raise RewardError(f"clip reward: convention {convention!r} must be 'cosine' or 'clipscore'")
        self.convention, self.device = convention, torch.device(device)
        if model == "tiny-shapes":
            self.model, self.tokenizer = load_tiny_clip(pretrained)
            self.size = self.model.visual.image_size[0] if isinstance(self.model.visual.image_size, tuple) \
                else self.model.visual.image_size
        else:
            import open_clip

            try:
                self.model, _, _ = open_clip.create_model_and_transforms(model, pretrained=pretrained)
            except Exception as exc:
                raise RewardError(f"clip reward: cannot load open_clip model {model!r} with pretrained={pretrained!r} "
                                  f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from exc
            self.tokenizer = open_clip.get_tokenizer(model)
            self.size = self.model.visual.image_size[0]
        self.model = self.model.to(self.device).eval().requires_grad_(False)

    @torch.no_grad()
    def embed(self, images: torch.Tensor, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        img = self.model.encode_image(preprocess(images.to(self.device), self.size), normalize=True)
        txt = self.model.encode_text(self.tokenizer(prompts).to(self.device), normalize=True)
        return img, txt

    def __call__(self, images, prompts, metadata=None):
        img, txt = self.embed(images, prompts)
        cos = (img * txt).sum(-1).float().cpu()
        return (100 * cos).clamp_min(0) if self.convention == "clipscore" else cos
