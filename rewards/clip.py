"""CLIP score with open_clip or transformers backbones, including the tiny shapes CLIP in ``assets/tiny_clip``.

cos = cosine(projected image embedding, projected text embedding). ``convention`` picks the scale (they differ
between papers; GRPO's per-group z-score removes the scale, multi-reward weights and logs do not):

- ``cosine`` (default): raw cos, DanceGRPO's multi-reward CLIP term (about 0.3-0.4 on real models);
- ``clipscore``: max(100 cos, 0), torchmetrics' CLIPScore;
- ``hessel``: 2.5 max(cos, 0), Hessel et al. 2021;
- ``flow_grpo``: logit_scale.exp() cos / 30 with no clamp (about 0.8-1.1), Flow-GRPO's ``clipscore``, which
  also preprocesses with a float-tensor bilinear resize and centre crop (``preprocess=tensor_bilinear``).

Backends: ``backend="open_clip"`` (model name + pretrained tag or local checkpoint; the shipped tiny CLIP is
``model="tiny-shapes"``) or ``backend="transformers"`` (a CLIPModel folder or hub id, e.g.
openai/clip-vit-large-patch14). Images arrive as (N, 3, H, W) in [0, 1].
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from flowrl.errors import RewardError
from flowrl.resources import assets_dir

from .backbones import PREPROCESS_MODES, HFClip, clip_pixels, normalize
from .loading import check_images, load_strict

TINY_CLIP_DIR = assets_dir() / "tiny_clip"


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
    load_strict(model, state, str(weights))
    tokenizer = open_clip.tokenizer.SimpleTokenizer(context_length=config["text_cfg"]["context_length"])
    return model.eval(), tokenizer


def preprocess(images: torch.Tensor, size: int) -> torch.Tensor:
    """(N, 3, H, W) in [0, 1] -> normalised (N, 3, size, size)."""
    x = images.float()
    if x.shape[-1] != size or x.shape[-2] != size:
        x = torch.nn.functional.interpolate(x, size=(size, size), mode="bicubic", align_corners=False, antialias=True)
    return normalize(x.clamp(0, 1))


CONVENTIONS = ("cosine", "clipscore", "hessel", "flow_grpo")


def scale_cosine(cos: torch.Tensor, convention: str, logit_scale: float) -> torch.Tensor:
    """Raw cosines -> the chosen CLIP-score convention (see the module docstring)."""
    if convention == "cosine":
        return cos
    if convention == "clipscore":
        return (100 * cos).clamp_min(0)
    if convention == "hessel":
        return 2.5 * cos.clamp_min(0)
    return logit_scale * cos / 30.0  # flow_grpo


class ClipScore:
    """CLIP score. ``model="tiny-shapes"`` (default) uses the shipped tiny CLIP; otherwise an open_clip model
    name with ``pretrained`` (a tag the user's machine can download, or a local checkpoint path), or with
    ``backend="transformers"`` a CLIPModel folder or hub id. ``preprocess``: ``pil`` (the references' uint8 PIL
    path), ``tensor_bilinear`` (Flow-GRPO's), ``letterbox``; default ``tensor_bilinear`` for the flow_grpo
    convention and ``pil`` otherwise (the tiny CLIP: a bicubic antialiased resize, as it was trained)."""

    def __init__(self, model: str = "tiny-shapes", pretrained: str | None = None, convention: str = "cosine",
                 backend: str = "open_clip", preprocess: str | None = None, processor: str | None = None,
                 device: str = "cpu"):
        if convention not in CONVENTIONS:
            raise RewardError(f"clip reward: convention {convention!r} must be one of {', '.join(CONVENTIONS)}")
        if backend not in ("open_clip", "transformers"):
            raise RewardError(f"clip reward: backend {backend!r} must be 'open_clip' or 'transformers'")
        self.convention, self.backend, self.device = convention, backend, torch.device(device)
        self.preprocess = preprocess or ("tensor_bilinear" if convention == "flow_grpo" else "pil")
        if self.preprocess not in PREPROCESS_MODES:
            raise RewardError(f"clip reward: preprocess {self.preprocess!r} must be one of {', '.join(PREPROCESS_MODES)}")
        self.tiny = model == "tiny-shapes"
        if backend == "transformers":
            self.hf = HFClip("clip", model, processor, device)
            return
        if self.tiny:
            self.model, self.tokenizer = load_tiny_clip(pretrained)
        else:
            import open_clip

            if pretrained and open_clip.get_pretrained_cfg(model, pretrained).get("quick_gelu") \
                    and "quickgelu" not in model.lower():
                raise RewardError(f"clip reward: the {pretrained!r} weights of {model} were trained with QuickGELU; "
                                  f"use model='{model}-quickgelu' (open_clip only warns and the scores are wrong)")
            try:
                self.model, _, _ = open_clip.create_model_and_transforms(model, pretrained=pretrained)
            except Exception as exc:
                where = ""
                tag_cfg = open_clip.get_pretrained_cfg(model, pretrained) if pretrained else {}
                if tag_cfg.get("hf_hub"):  # say which repository holds the weights the tag names
                    where = (f"; the weights are in the Hugging Face repository {tag_cfg['hf_hub'].rstrip('/')}: "
                             "download it where the hub is reachable and pass pretrained=/path/to/the/weights file")
                raise RewardError(f"clip reward: cannot load open_clip model {model!r} with pretrained={pretrained!r} "
                                  f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}){where}") from exc
            self.tokenizer = open_clip.get_tokenizer(model)
        size = self.model.visual.image_size
        self.size = size[0] if isinstance(size, (tuple, list)) else int(size)
        self.model = self.model.to(self.device).eval().requires_grad_(False)

    @property
    def logit_scale(self) -> float:
        return self.hf.logit_scale if self.backend == "transformers" else float(self.model.logit_scale.exp())

    @torch.no_grad()
    def embed_images(self, images: torch.Tensor) -> torch.Tensor:
        """(N, 3, H, W) in [0, 1] -> normalised image embeddings (N, D)."""
        if self.backend == "transformers":
            return self.hf.embed_images(images, self.preprocess)
        pixels = preprocess(images, self.size) if self.tiny else clip_pixels(images, self.size, self.preprocess)
        return self.model.encode_image(pixels.to(self.device), normalize=True).float()

    @torch.no_grad()
    def embed_text(self, prompts: list[str]) -> torch.Tensor:
        if self.backend == "transformers":
            return self.hf.embed_text(prompts)
        return self.model.encode_text(self.tokenizer(prompts).to(self.device), normalize=True).float()

    def embed(self, images: torch.Tensor, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.embed_images(images), self.embed_text(list(prompts))

    def score_with_grad(self, images: torch.Tensor, prompts: list[str], metadata=None) -> torch.Tensor:
        """The score (N,) with its graph back to the images (N, 3, H, W) (reward backpropagation, guidance); the
        model's weights stay frozen. The preprocessing must be differentiable (not ``pil``)."""
        check_images("clip", images)
        if self.backend == "transformers" or (not self.tiny and self.preprocess == "pil"):
            raise RewardError("clip reward: gradients need the open_clip backend with preprocess='tensor_bilinear' "
                              "or 'letterbox' (the PIL path leaves the graph)")
        pixels = preprocess(images, self.size) if self.tiny else clip_pixels(images, self.size, self.preprocess)
        img = self.model.encode_image(pixels.to(self.device), normalize=True).float()
        txt = self.embed_text(list(prompts))
        return scale_cosine((img * txt).sum(-1), self.convention, self.logit_scale)

    def __call__(self, images, prompts, metadata=None):
        check_images("clip", images)
        img, txt = self.embed(images, prompts)
        return scale_cosine((img * txt).sum(-1).float().cpu(), self.convention, self.logit_scale)
