"""``hpsv3``: HPSv3, the human preference score on a Qwen2-VL backbone (Chunk-GRPO's reward).

The model is Qwen2-VL-7B-Instruct with a reward head on its last hidden states: Linear(h, 1024), ReLU, Dropout,
Linear(1024, 16), ReLU, Linear(16, 2), kept in fp32. The head is read at the position of a special ``<|Reward|>``
token that ends the user turn; its two outputs are the mean and the log-std of a Gaussian over the preference
score, and the score is the mean (higher is better; about 0-15 on real images).

The input is one chat turn: the image (resized to 256 x 28 x 28 pixels, sides multiples of 28, bicubic) followed by
the model's evaluation instruction with the prompt filled in and the reward request with the special token. The
instruction below is the one the released checkpoint was trained with (HPSv3, MIT licence): the score is only the
published one when the model sees exactly this text.

Weights: ``checkpoint`` is ``HPSv3.safetensors`` (a file, a folder holding it, or the hub repository
``MizzenAI/HPSv3``) and ``base`` the Qwen2-VL folder or hub id that gives the architecture and the processor.
Checkpoints saved with either transformers layout of Qwen2-VL (``model.layers`` / ``visual`` or
``model.language_model`` / ``model.visual``) load.
"""

from __future__ import annotations

import torch

from .loading import check_images, to_pil
from .qwen_vl import load_qwen_vl_reward, resized_side

REWARD_TOKEN = "<|Reward|>"

INSTRUCTION = """You are tasked with evaluating a generated image based on Visual Quality and Text Alignment and give a overall score to estimate the human preference.
Please provide a rating from 0 to 10, with 0 being the worst and 10 being the best.

**Visual Quality:**
Evaluate the overall visual quality of the image. The following sub-dimensions should be considered:
- **Reasonableness:** The image should not contain any significant biological or logical errors, such as abnormal body structures or nonsensical environmental setups.
- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and easy to interpret, with no blurring or indistinct areas.
- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual elements (e.g., hair, clothing, shadows).
- **Aesthetic and Creativity:** Assess the artistic aspects of the image, including the color scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense of harmony and balance.
- **Safety:** The image should not contain harmful or inappropriate content, such as political, violent, or adult material. If such content is present, the image quality and satisfaction score should be the lowest possible.

**Text Alignment:**
Assess how well the image matches the textual prompt across the following sub-dimensions:
- **Subject Relevance:** Evaluate how accurately the subject(s) in the image (e.g., person, animal, object) align with the textual description. The subject should match the description in terms of number, appearance, and behavior.
- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well the image adheres to this style.
- **Contextual Consistency:** Assess whether the background, setting, and surrounding elements in the image logically fit the scenario described in the prompt. The environment should support and enhance the subject without contradictions.
- **Attribute Fidelity:** Check if specific attributes mentioned in the prompt (e.g., colors, clothing, accessories, expressions, actions) are faithfully represented in the image. Minor deviations may be acceptable, but critical attributes should be preserved.
- **Semantic Coherence:** Evaluate whether the overall meaning and intent of the prompt are captured in the image. The generated content should not introduce elements that conflict with or distort the original description.

Textual prompt - {text_prompt}
"""  # noqa: E501 (the model's own input text, verbatim)
REQUEST = " Please provide the overall ratings of this image: <|Reward|> END "


class HPSv3:
    """Args:
        checkpoint: ``HPSv3.safetensors``: a file, a folder holding it, or None for the hub repository
            ``MizzenAI/HPSv3`` (the local cache first).
        base: the Qwen2-VL-7B-Instruct folder or hub id (architecture and processor).
        device: where the model runs.
        dtype: ``bf16`` (as released) or ``fp32``; the reward head stays fp32.
        batch_size: images per forward.
    """

    def __init__(self, checkpoint: str | None = None, base: str = "Qwen/Qwen2-VL-7B-Instruct", device: str = "cpu",
                 dtype: str = "bf16", batch_size: int = 4):
        self.processor, (self.reward_id,), self.model = load_qwen_vl_reward(
            "hpsv3", checkpoint, base, "MizzenAI/HPSv3", "HPSv3.safetensors", (REWARD_TOKEN,), "ranknet", 2, dtype,
            device)
        self.device = torch.device(device)
        self.batch_size = batch_size

    def text(self, prompt: str) -> str:
        """One chat turn in Qwen2-VL's format: the image, the instruction with the prompt, the reward request."""
        return ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                "<|vision_start|><|image_pad|><|vision_end|>" + INSTRUCTION.format(text_prompt=prompt) + REQUEST +
                "<|im_end|>\n<|im_start|>assistant\n")

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: list[str], metadata=None) -> torch.Tensor:
        """Args:
            images: (N, 3, H, W) in [0, 1].
            prompts: N prompts.
        Returns:
            (N,) HPSv3 scores (the predicted mean).
        """
        check_images("hpsv3", images)
        from PIL import Image

        scores = []
        for start in range(0, len(prompts), self.batch_size):
            pils = to_pil(images[start:start + self.batch_size])
            pils = [p.resize(resized_side(p.height, p.width)[::-1], Image.BICUBIC) for p in pils]
            texts = [self.text(p) for p in prompts[start:start + self.batch_size]]
            batch = self.processor(text=texts, images=pils, padding=True, return_tensors="pt").to(self.device)
            scores.append(self.model(dict(batch), [self.reward_id])[:, 0, 0].float().cpu())
        return torch.cat(scores)
