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

SCALES = ("official", "flow_grpo", "cosine")


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


class RandomPickScore(PickScore):
    """The PickScore reward with a random-weight CLIP ViT-H/14 (or its shrunk twin), built on the accelerator where
    there is one: ``rewards[i].name: flowrl.rewards.pickscore:RandomPickScore`` (``flowrl gpu-check``'s
    end-to-end stage times a preset at real size with it; its scores are arbitrary)."""

    def __init__(self, scale: str = "flow_grpo", shrunk: bool = False, seed: int = 1):
        from transformers import CLIPConfig, CLIPModel

        from flowrl.models.published import CLIP_VOCAB, REAL, SHRUNK, build_device, built_on

        sizes = (SHRUNK if shrunk else REAL)["reward"]
        device, dtype = build_device()
        torch.manual_seed(seed)
        config = CLIPConfig(text_config=dict(sizes["text"], vocab_size=CLIP_VOCAB, bos_token_id=49406,
                                             eos_token_id=49407, pad_token_id=49407),
                            vision_config=sizes["vision"], projection_dim=sizes["projection_dim"],
                            logit_scale_init_value=sizes["logit_scale_init_value"])
        with built_on(device, dtype):
            model = CLIPModel(config).eval()
        super().__init__(model=model, processor=None, scale=scale, device=str(device))
