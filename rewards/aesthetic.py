"""LAION improved aesthetic predictor v2 (the DDPO / Flow-GRPO ``aesthetic`` reward).

score = MLP(e / ||e||), e = the projected CLIP ViT-L/14 image embedding (768-d). The head is the official
``layers.{0,2,4,6,7}`` stack of Linear layers with dropout between them and no activations
(``sac+logos+ava1-l14-linearMSE.pth``, a bare fp32 state dict); the output is on the AVA 1-10 scale and is
returned raw. Images go through the references' uint8 -> PIL CLIP preprocessing (bicubic shortest-side resize,
centre crop 224, OpenAI mean/std).
"""

from __future__ import annotations

import torch
from torch import nn

from flowrl.errors import RewardError

from .backbones import HFClip
from .loading import check_images, load_strict, read_state_dict

HEAD_FILE = "sac+logos+ava1-l14-linearMSE.pth"
HEAD_SOURCE = "https://github.com/christophschuhmann/improved-aesthetic-predictor"


class AestheticHead(nn.Module):
    """The official head: keys layers.0/2/4/6/7 (Linear) with Dropout at 1, 3, 5; no activations."""

    def __init__(self, embed_dim: int = 768):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(embed_dim, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
            nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1))

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:  # (N, D) normalised -> (N,)
        return self.layers(embeddings).squeeze(-1)


class AestheticReward:
    """``clip``: folder or hub id of the CLIP ViT-L/14 (default openai/clip-vit-large-patch14);
    ``head``: path to ``sac+logos+ava1-l14-linearMSE.pth`` (or a .safetensors with the same keys)."""

    def __init__(self, head: str | None = None, clip="openai/clip-vit-large-patch14", processor: str | None = None,
                 device: str = "cpu"):
        if not head:
            raise RewardError(f"aesthetic: give head=/path/to/{HEAD_FILE} (download it from {HEAD_SOURCE}; "
                              "3.7 MB, Apache-2.0)")
        self.clip = HFClip("aesthetic", clip, processor, device)
        self.head = AestheticHead(self.clip.model.config.projection_dim)
        load_strict(self.head, read_state_dict(head), f"aesthetic head {head}")
        self.head = self.head.to(self.clip.device).eval().requires_grad_(False)

    def embed_images(self, images: torch.Tensor) -> torch.Tensor:
        return self.clip.embed_images(images, "pil")

    @torch.no_grad()
    def __call__(self, images, prompts=None, metadata=None):
        check_images("aesthetic", images)
        return self.head(self.embed_images(images)).float().cpu()
