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

import math

import torch

from flowrl.errors import RewardError

from .loading import check_images, load_strict, read_state_dict, resolve_file, resolve_pretrained_dir, to_pil
from .registry import register_reward

REWARD_TOKEN = "<|Reward|>"
PIXELS = 256 * 28 * 28  # HPSv3's min_pixels = max_pixels
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


def resized_side(height: int, width: int, pixels: int = PIXELS, factor: int = 28) -> tuple[int, int]:
    """Qwen2-VL's resize rule with min_pixels = max_pixels = ``pixels``: sides rounded to multiples of ``factor``,
    scaled (down, floored; or up, ceiled) so that the area meets the bound."""
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > pixels:
        beta = math.sqrt(height * width / pixels)
        h, w = math.floor(height / beta / factor) * factor, math.floor(width / beta / factor) * factor
    elif h * w < pixels:
        beta = math.sqrt(pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


class HPSv3Model(torch.nn.Module):
    """Qwen2-VL (without its language-model head) and HPSv3's reward head, read at the reward token."""

    def __init__(self, config):
        super().__init__()
        from transformers import Qwen2VLModel

        self.backbone = Qwen2VLModel(config)
        hidden = config.text_config.hidden_size if hasattr(config, "text_config") else config.hidden_size
        self.rm_head = torch.nn.Sequential(torch.nn.Linear(hidden, 1024), torch.nn.ReLU(), torch.nn.Dropout(0.05),
                                           torch.nn.Linear(1024, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))

    def forward(self, inputs: dict, reward_token_id: int) -> torch.Tensor:
        """Args:
            inputs: the processor's batch (input_ids (B, L), attention_mask, pixel_values, image_grid_thw).
            reward_token_id: the id of ``<|Reward|>``; each row holds it once.
        Returns:
            (B, 2): the Gaussian's mean and log-std per image.
        """
        hidden = self.backbone(**inputs).last_hidden_state  # (B, L, h)
        logits = self.rm_head(hidden.float())  # (B, L, 2)
        at = inputs["input_ids"] == reward_token_id
        if not torch.equal(at.sum(1), torch.ones_like(at.sum(1))):
            raise RewardError("hpsv3: every input must hold the reward token exactly once")
        return logits[at]  # (B, 2), one position per row


def remap_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HPSv3.safetensors' names (either transformers layout of Qwen2-VL) -> :class:`HPSv3Model`'s."""
    out = {}
    for key, value in state.items():
        if key.startswith("lm_head."):
            continue  # the language-model head is not used for scoring
        for old, new in (("model.language_model.", "backbone.language_model."), ("model.visual.", "backbone.visual."),
                         ("model.", "backbone.language_model."), ("visual.", "backbone.visual.")):
            if key.startswith(old):
                key = new + key[len(old):]
                break
        out[key] = value
    return out


@register_reward("hpsv3")
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
        from transformers import AutoConfig, AutoProcessor

        try:  # random initialisation of 8B parameters that the checkpoint overwrites anyway: skipped
            from transformers.initialization import no_init_weights
        except ImportError:  # transformers 4
            from transformers.modeling_utils import no_init_weights

        if dtype not in ("bf16", "fp32"):
            raise RewardError(f"hpsv3: dtype must be bf16 or fp32, not {dtype!r}")
        folder = resolve_pretrained_dir("hpsv3", base, "Qwen2-VL's config.json and processor files")
        weights = resolve_file("hpsv3", checkpoint, "MizzenAI/HPSv3", "HPSv3.safetensors")
        self.processor = AutoProcessor.from_pretrained(folder)
        tok = self.processor.tokenizer
        if REWARD_TOKEN not in tok.get_vocab():
            tok.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
        self.reward_id = tok.convert_tokens_to_ids(REWARD_TOKEN)
        with no_init_weights():
            model = HPSv3Model(AutoConfig.from_pretrained(folder))
        load_strict(model, remap_keys(read_state_dict(weights)), str(weights))
        self.device = torch.device(device)
        if dtype == "bf16":
            model.backbone.to(torch.bfloat16)
        self.model = model.to(self.device).eval().requires_grad_(False)
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
            scores.append(self.model(dict(batch), self.reward_id)[:, 0].float().cpu())
        return torch.cat(scores)
