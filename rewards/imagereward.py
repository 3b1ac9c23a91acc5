"""ImageReward v1.0 through the official ``image-reward`` package (BLIP ViT-L + BERT cross-encoder + MLP).

ImageReward is best used as an evaluation metric: it is a large BLIP model scored one image at a time, and
policies trained on it learn its biases quickly. It needs ``pip install image-reward`` and, offline,
``ImageReward.pt`` and ``med_config.json`` from the Hugging Face repository THUDM/ImageReward in
``download_root`` (plus bert-base-uncased's tokenizer files in the Hugging Face cache).
"""

from __future__ import annotations

import numpy as np
import torch

from flowrl.errors import RewardError

from .loading import check_images, to_pil


class ImageReward:
    def __init__(self, name: str = "ImageReward-v1.0", download_root: str | None = None, device: str = "cpu"):
        try:
            import ImageReward as RM
        except ImportError as exc:
            raise RewardError("imagereward: needs the official package; pip install image-reward (weights: "
                              "ImageReward.pt and med_config.json from the Hugging Face repository THUDM/ImageReward)") from exc
        try:
            self.model = RM.load(name, device=device, download_root=download_root)
        except Exception as exc:
            raise RewardError(f"imagereward: cannot load {name!r} ({str(exc).splitlines()[0] if str(exc) else exc!r}); "
                              "offline, put ImageReward.pt and med_config.json from THUDM/ImageReward in "
                              "download_root") from exc
        self.model.eval().requires_grad_(False)

    @torch.no_grad()
    def __call__(self, images, prompts, metadata=None):
        check_images("imagereward", images)
        # one pair per call, as Flow-GRPO's scorer does; score() gives a float or a one-element list
        scores = [float(np.ravel(self.model.score(p, img))[0]) for p, img in zip(prompts, to_pil(images))]
        return torch.tensor(scores)
