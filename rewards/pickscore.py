"""PickScore: a transformers CLIPModel (laion ViT-H-14 fine-tuned, ``yuvalkirstain/PickScore_v1``) with the laion
ViT-H-14 processor (``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``).

cos = <normalize(image embedding), normalize(text embedding)> from ``get_*_features`` (``pooler_output`` on
transformers 5). ``scale``: ``official`` = logit_scale.exp() * cos (the PickScore README, about 18-23),
``flow_grpo`` = that / 26 (about 0.7-0.9), ``cosine`` = raw cos (DanceGRPO / BranchGRPO). Prompts are
tokenized without ftfy cleaning, as the official fast tokenizer does.
"""

from __future__ import annotations

import torch

from flowrl.errors import RewardError

from .backbones import HFClip
from .loading import check_images
from .registry import register_reward

SCALES = ("official", "flow_grpo", "cosine")


@register_reward("pickscore")
class PickScore:
    def __init__(self, model="yuvalkirstain/PickScore_v1", processor: str | None = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
                 scale: str = "official", device: str = "cpu"):
        if scale not in SCALES:
            raise RewardError(f"pickscore: scale {scale!r} must be one of {', '.join(SCALES)}")
        self.scale = scale
        # the laion processor equals the offline-built one (CLIP BPE, bicubic 224, crop); fall back to it offline
        self.clip = HFClip("pickscore", model, processor, device, processor_fallback=True)

    def embed_images(self, images: torch.Tensor) -> torch.Tensor:
        return self.clip.embed_images(images, "pil")

    def __call__(self, images, prompts, metadata=None):
        check_images("pickscore", images)
        cos = (self.embed_images(images) * self.clip.embed_text(list(prompts))).sum(-1).cpu()
        if self.scale == "cosine":
            return cos
        score = self.clip.logit_scale * cos
        return score / 26.0 if self.scale == "flow_grpo" else score
