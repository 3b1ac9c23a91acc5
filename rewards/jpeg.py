"""JPEG (in)compressibility (DDPO): the file size of the image saved as JPEG at quality 95.

``jpeg_incompressibility`` = size in kB (1000 bytes); ``jpeg_compressibility`` = -size_kB / scale, with
``scale = 500`` by default (flow_grpo's convention, near [-1, 0] at 512 px); ``scale = 1`` gives DDPO's.
"""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image



def jpeg_sizes_kb(images: torch.Tensor, quality: int = 95) -> np.ndarray:
    """(N, 3, H, W) in [0, 1] -> JPEG sizes in kB (decimal)."""
    arr = (images.detach().float().cpu() * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    sizes = []
    for img in arr:
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=quality)
        sizes.append(buf.tell() / 1000.0)
    return np.asarray(sizes, dtype=np.float64)


class JpegCompressibility:
    def __init__(self, scale: float = 500.0, quality: int = 95):
        self.scale, self.quality = scale, quality

    def __call__(self, images, prompts=None, metadata=None):
        return -jpeg_sizes_kb(images, self.quality) / self.scale


class JpegIncompressibility:
    def __init__(self, scale: float = 1.0, quality: int = 95):
        self.scale, self.quality = scale, quality

    def __call__(self, images, prompts=None, metadata=None):
        return jpeg_sizes_kb(images, self.quality) / self.scale
