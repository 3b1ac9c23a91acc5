"""``editreward``: EditReward, a human-preference reward for instruction-guided image edits on a Qwen2.5-VL backbone.

The model is Qwen2.5-VL-7B-Instruct with a ``<|Reward|>`` token added to its vocabulary and two reward heads
(``rm_heads.head_0`` and ``head_1``), each HPSv3's ``ranknet`` head (Linear(h, 1024), ReLU, Dropout, Linear(1024, 16),
ReLU, Linear(16, 2)) in fp32 whose two outputs are the mean and the log-std of a Gaussian over the score. It reads
an edit twice, both times as one chat turn holding the source image, the edited image and a text: the first pass
asks for instruction following (head 0), the second for visual quality (head 1), each read at the ``<|Reward|>``
token. The released configuration pools the two heads by their mean, so the score is the mean of the two heads'
means (higher is better).

Both images are resized to 256 x 28 x 28 pixels (sides multiples of 28, bicubic), the released inference's
``min_pixels = max_pixels``. The source is the edit request's first source image at the result's size, the image
the editing model was given. The texts below are the ones the released checkpoint was trained with (EditReward,
MIT licence): the score is only the published one when the model sees exactly these.

Weights: ``checkpoint`` is the released state dict, ``model.safetensors`` or ``model.pth`` (a file, a folder holding
it, or the hub repository ``TIGER-Lab/EditReward-Qwen2.5-7B-VL``), and ``base`` the Qwen2.5-VL folder or hub id that
gives the architecture and the processor. Either transformers layout of the backbone's names loads.
"""

from __future__ import annotations

from pathlib import Path

import torch

from flowrl.editing import source_tensor
from flowrl.errors import RewardError

from .loading import check_images, to_pil
from .qwen_vl import load_qwen_vl_reward, resized_side

REWARD_TOKEN = "<|Reward|>"
REPO_ID = "TIGER-Lab/EditReward-Qwen2.5-7B-VL"

INSTRUCTION_FOLLOWING = """
You are tasked with evaluating an edited image **in comparison with the original source image** based on **Instruction Following & Semantic Fidelity**, and assigning a score from 1 to 4, with 1 being the worst and 4 being the best.  
This dimension focuses on how accurately, completely, and exclusively the model executed the given text instruction.

**Inputs Provided:**  
- Source Image (before editing)  
- Edited Image (after applying the instruction)  
- Text Instruction  

**Sub-Dimensions to Evaluate:**

- **Semantic Accuracy:**  
  Assess whether the edited content accurately captures the semantics of the instruction. The edited result should precisely match the intended meaning. For example, if the instruction is "replace apples with oranges," the object must clearly be oranges, not other fruits.

- **Completeness of Editing:**  
  Check whether **all parts** of the instruction are fully executed. For multi-step edits (e.g., "replace a red car with a blue bicycle"), both the color change and the object replacement must be done without omissions.

- **Exclusivity of Edit (No Over-Editing):**  
  Ensure that only the requested parts are changed. The rest of the image (as seen in the source) should remain unaltered. For example, if the instruction only involves replacing an object, the background, lighting, and unrelated objects should not be unnecessarily modified.

**Scoring Criteria:**
- **4 (Very Good):** Perfectly accurate, complete, and exclusive execution of the instruction.  
- **3 (Relatively Good):** Largely correct, but with minor omissions or slight over-editing.  
- **2 (Relatively Poor):** Major misinterpretation, incomplete edits, or noticeable unintended changes.  
- **1 (Very Poor):** Instruction ignored or completely wrong execution.

Text instruction - {text_prompt}
"""  # noqa: E501 (the model's own input text, verbatim)

VISUAL_QUALITY = """
You are tasked with evaluating an edited image **in comparison with the original source image** based on **Visual Quality & Realism**, and assigning a score from 1 to 4, with 1 being the worst and 4 being the best.  
This dimension focuses on how realistic, artifact-free, and aesthetically appealing the edited image is, while remaining consistent with the source image.

**Inputs Provided:**  
- Source Image (before editing)  
- Edited Image (after applying the instruction)  
- Text Instruction  

**Sub-Dimensions to Evaluate:**

- **Plausibility & Physical Consistency:**  
  Check whether the edit aligns with the laws of physics and the scene context. Lighting, shadows, reflections, perspective, size, and interactions with the environment should all appear natural compared to the source image.

- **Artifact-Free Quality:**  
  Look for technical flaws such as blur, distortions, pixel misalignment, unnatural textures, or seams around edited regions. High-quality results should be free from such visible artifacts.

- **Aesthetic Quality:**  
  Evaluate the overall harmony and visual appeal. The image should look natural, balanced, and pleasant. Colors, composition, and atmosphere should enhance the image rather than degrade it.

**Scoring Criteria:**
- **4 (Very Good):** Perfectly realistic, artifact-free, seamless, and aesthetically pleasing.  
- **3 (Relatively Good):** Mostly realistic and clean, with only minor flaws that do not significantly distract.  
- **2 (Relatively Poor):** Noticeable physical inconsistencies or visible artifacts that make the edit unnatural.  
- **1 (Very Poor):** Severe artifacts, incoherent composition, or visually unusable result.

Text instruction - {text_prompt}
"""  # noqa: E501 (the model's own input text, verbatim)
REQUEST = "\nPlease provide the overall ratings of this image: <|Reward|>\n\nEND\n"
PASSES = (INSTRUCTION_FOLLOWING, VISUAL_QUALITY)  # head i reads pass i


def _weights(checkpoint: str | None) -> str | None:
    """A folder holding ``model.pth`` but no ``model.safetensors`` names the former."""
    if checkpoint and Path(checkpoint).is_dir():
        folder = Path(checkpoint)
        if not (folder / "model.safetensors").is_file() and (folder / "model.pth").is_file():
            return str(folder / "model.pth")
    return checkpoint


class EditReward:
    """Args:
        checkpoint: the released weights (``model.safetensors`` / ``model.pth``): a file, a folder holding one, or
            None for the hub repository ``TIGER-Lab/EditReward-Qwen2.5-7B-VL`` (the local cache first).
        base: the Qwen2.5-VL-7B-Instruct folder or hub id (architecture and processor).
        device: where the model runs.
        dtype: ``bf16`` (as released) or ``fp32``; the heads stay fp32.
        batch_size: edits per forward.
    """

    def __init__(self, checkpoint: str | None = None, base: str = "Qwen/Qwen2.5-VL-7B-Instruct", device: str = "cpu",
                 dtype: str = "bf16", batch_size: int = 2):
        self.processor, (self.reward_id,), self.model = load_qwen_vl_reward(
            "editreward", _weights(checkpoint), base, REPO_ID, "model.safetensors", (REWARD_TOKEN,), "ranknet", 2,
            dtype, device, heads=len(PASSES))
        self.device = torch.device(device)
        self.batch_size = batch_size

    @staticmethod
    def text(instruction: str, head: int) -> str:
        """One chat turn in Qwen2.5-VL's format (its default system prompt): the source, the edited image, pass
        ``head``'s text with the instruction and the reward request."""
        image = "<|vision_start|><|image_pad|><|vision_end|>"
        return ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n" + image + image +
                PASSES[head].format(text_prompt=instruction) + REQUEST + "<|im_end|>\n<|im_start|>assistant\n")

    @staticmethod
    def resized(images: torch.Tensor) -> list:
        """(N, 3, H, W) in [0, 1] -> PIL images at Qwen2-VL's 256 x 28 x 28-pixel size (bicubic)."""
        from PIL import Image

        return [p.resize(resized_side(p.height, p.width)[::-1], Image.BICUBIC) for p in to_pil(images)]

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: list[str], metadata=None) -> torch.Tensor:
        """Args:
            images: (N, 3, H, W) in [0, 1], the edited images.
            prompts: N edit requests (their first source image is the edit's source).
        Returns:
            (N,) EditReward scores: the mean over the two heads of each head's predicted mean.
        """
        check_images("editreward", images)
        if images.ndim != 4:
            raise RewardError("editreward scores edited images (N, 3, H, W)")
        sources = source_tensor(prompts, images.shape[-1])  # (N, 3, S, S) in [0, 1]
        scores = []
        for start in range(0, len(prompts), self.batch_size):
            rows = slice(start, start + self.batch_size)
            pils = [p for pair in zip(self.resized(sources[rows]), self.resized(images[rows])) for p in pair]
            per_head = []
            for head in range(len(PASSES)):
                texts = [self.text(str(p), head) for p in prompts[rows]]
                batch = self.processor(text=texts, images=pils, padding=True, return_tensors="pt").to(self.device)
                per_head.append(self.model(dict(batch), [self.reward_id], head=head)[:, 0, 0].float().cpu())
            scores.append(torch.stack(per_head).mean(0))
        return torch.cat(scores)
