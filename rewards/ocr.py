"""``ocr``: the text-rendering reward (Flow-GRPO's OCR task). The prompt asks for a text between double quotes
(``a sign that says "Hello World"``); an OCR model reads the image, and the score is one minus the normalised
edit distance between what it reads and the asked text.

Conventions, as Flow-GRPO's published scorer has them:

- the target is the text between the prompt's first pair of double quotes (the whole prompt when it has none);
- spaces are removed and both texts lower-cased before comparing;
- the read text is every detected line with a confidence above 0, concatenated in reading order;
- a target contained in the read text scores 1 (extra text around it costs nothing); otherwise the Levenshtein
  distance, capped at the target's length, gives ``1 - distance / len(target)`` in [0, 1].

The OCR model is RapidOCR (PP-OCRv4 detection and recognition as ONNX), whose wheel carries its models, so it
runs on a CPU with no download: ``pip install 'flowrl-tree[ocr]'``. The edit distance comes from rapidfuzz.
"""

from __future__ import annotations

import numpy as np
import torch

from flowrl.errors import RewardError



def target_text(prompt: str) -> str:
    """The text a prompt asks to render: between its first pair of double quotes, else the whole prompt."""
    parts = prompt.split('"')
    return parts[1] if len(parts) >= 3 else prompt


def normalise(text: str) -> str:
    return text.replace(" ", "").lower()


def text_score(read: str, target: str) -> float:
    """1 - Levenshtein(read, target) / len(target) on the normalised texts, the distance capped at len(target);
    1 when the target appears inside what was read."""
    from rapidfuzz.distance import Levenshtein

    read, target = normalise(read), normalise(target)
    if not target:
        return float("nan")  # nothing was asked: the sample cannot be scored (masked and counted)
    if target in read:
        return 1.0
    distance = min(Levenshtein.distance(read, target), len(target))
    return 1.0 - distance / len(target)


class OCRReward:
    """Scores text rendering with RapidOCR.

    Args:
        min_confidence: lines read with a confidence at or below this are ignored (0: Flow-GRPO's rule).
        use_angle_classifier: also run the text-direction classifier (off in Flow-GRPO's scorer).
    """

    def __init__(self, min_confidence: float = 0.0, use_angle_classifier: bool = False):
        try:
            from rapidocr_onnxruntime import RapidOCR
        except ImportError as exc:
            raise RewardError("the ocr reward needs RapidOCR: pip install 'flowrl-tree[ocr]' "
                              "(rapidocr-onnxruntime and rapidfuzz)") from exc
        self.engine = RapidOCR()
        self.min_confidence, self.use_cls = min_confidence, use_angle_classifier

    def read(self, image: np.ndarray) -> str:
        """The text of one (H, W, 3) uint8 RGB image, its lines concatenated in reading order."""
        result, _ = self.engine(image[:, :, ::-1].copy(), use_cls=self.use_cls)  # RapidOCR reads BGR, as OpenCV
        if not result:
            return ""
        return "".join(text for _box, text, confidence in result if float(confidence) > self.min_confidence)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: list[str], metadata=None) -> torch.Tensor:
        """Args:
            images: (N, 3, H, W) in [0, 1].
            prompts: N prompts, each with the asked text between double quotes (or ``metadata[i]["text"]``).
            metadata: N dicts; a ``text`` entry overrides the quoted text.
        Returns:
            (N,) scores in [0, 1].
        """
        if images.dim() != 4:
            raise RewardError("the ocr reward scores images (N, 3, H, W); wrap it in video_frames for videos")
        arr = (images.detach().float().cpu().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
        scores = []
        for i, (image, prompt) in enumerate(zip(arr, prompts)):
            meta = metadata[i] if metadata and isinstance(metadata[i], dict) else {}
            target = meta.get("text") or target_text(prompt)
            scores.append(text_score(self.read(image), target))
        return torch.tensor(scores, dtype=torch.float32)
