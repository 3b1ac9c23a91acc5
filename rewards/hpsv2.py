"""HPSv2 / HPSv2.1 (Human Preference Score): a whole open_clip ViT-H-14 fine-tuned on human preferences.

score = cos(image features, text features), both L2-normalised, no logit scale and no clamp (v2.1 about
0.20-0.37). Checkpoints ``HPS_v2_compressed.pt`` (v2.0) and ``HPS_v2.1_compressed.pt`` (v2.1) from the
Hugging Face repository ``xswu/HPSv2`` hold ``{'state_dict': ...}`` with the complete open_clip key set; a bare
state dict or a .safetensors file is accepted too. Preprocessing is HPS's letterbox on the uint8-quantised image: the longer side resized to
224 (bicubic, antialiased) and the rest padded black, then the OpenAI mean/std. Text goes through open_clip's
tokenizer (ftfy + HTML cleaning, zero padding, 77 tokens).
"""

from __future__ import annotations

import torch

from flowrl.errors import RewardError

from .backbones import clip_pixels
from .loading import check_images, load_strict, read_state_dict, resolve_file, to_uint8

HPS_REPO = "xswu/HPSv2"
HPS_FILES = {"v2.0": "HPS_v2_compressed.pt", "v2.1": "HPS_v2.1_compressed.pt"}


def build_open_clip_model(model: str | dict):
    """An open_clip ``CLIP`` without weights: a built-in model name (e.g. ViT-H-14) or a config dict
    (embed_dim, vision_cfg, text_cfg), as ``open_clip.add_model_config`` takes."""
    import open_clip

    if isinstance(model, dict):
        from .clip import build_open_clip

        return build_open_clip(model)
    if model not in open_clip.list_models():
        raise RewardError(f"unknown open_clip model {model!r} (for example ViT-H-14; see open_clip.list_models())")
    return open_clip.create_model(model, pretrained=None)


class HPSv2:
    """``version`` v2.1 (default; Flow-GRPO, DanceGRPO) or v2.0; ``checkpoint``: a local file or folder
    (default: the version's file from xswu/HPSv2); ``model``: the open_clip architecture (ViT-H-14)."""

    def __init__(self, version: str = "v2.1", checkpoint: str | None = None, model: str | dict = "ViT-H-14",
                 device: str = "cpu"):
        import open_clip

        if version not in HPS_FILES:
            raise RewardError(f"hpsv2: version {version!r} must be one of {', '.join(HPS_FILES)}")
        self.device = torch.device(device)
        path = resolve_file("hpsv2", checkpoint, HPS_REPO, HPS_FILES[version])
        self.model = build_open_clip_model(model)
        load_strict(self.model, read_state_dict(path), f"hpsv2 checkpoint {path}")
        self.model = self.model.to(self.device).eval().requires_grad_(False)
        size = self.model.visual.image_size
        self.size = size[0] if isinstance(size, (tuple, list)) else int(size)
        ctx = int(self.model.positional_embedding.shape[0])
        self.tokenizer = open_clip.tokenizer.SimpleTokenizer(context_length=ctx)

    @torch.no_grad()
    def embed_images(self, images: torch.Tensor) -> torch.Tensor:
        # the references hand HPS uint8 PIL images (ToTensor then letterbox): quantise the same way
        pixels = clip_pixels(to_uint8(images).float() / 255, self.size, "letterbox").to(self.device)
        return self.model.encode_image(pixels, normalize=True).float()

    @torch.no_grad()
    def __call__(self, images, prompts, metadata=None):
        check_images("hpsv2", images)
        txt = self.model.encode_text(self.tokenizer(list(prompts)).to(self.device), normalize=True).float()
        return (self.embed_images(images) * txt).sum(-1).cpu()
