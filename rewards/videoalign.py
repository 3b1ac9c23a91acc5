"""``videoalign``: VideoReward (VideoAlign), a video reward model on Qwen2-VL-2B with three scores: visual quality
(VQ), motion quality (MQ) and text alignment (TA).

The model reads a clip sampled at 2 frames per second (at least 4 frames, an even count; each frame resized to
about 256 x 28 x 28 pixels, sides multiples of 28) and its evaluation instruction, in which three special tokens
(``<|VQ_reward|>``, ``<|MQ_reward|>``, ``<|TA_reward|>``) close the three criteria; a bias-free linear head reads one
number at each. Each is normalised with the means and stds the release states, and ``Overall`` is their sum.
The instruction is the one the released checkpoint was trained with (VideoAlign, Apache-2.0): the scores are only
the published ones when the model sees exactly this text.

Weights: ``checkpoint`` is the release's ``model.safetensors`` (a file or the folder holding it; hub repository
``KwaiVGI/VideoReward``) and ``base`` the Qwen2-VL-2B-Instruct folder or hub id for the architecture and processor.
"""

from __future__ import annotations

import torch

from flowrl.errors import RewardError

from .qwen_vl import PIXELS, load_qwen_vl_reward, resized_side

TOKENS = ("<|VQ_reward|>", "<|MQ_reward|>", "<|TA_reward|>")
NORM = {"VQ": (3.6757, 2.2476), "MQ": (1.1646, 1.3811), "TA": (2.8105, 2.5121)}  # the release's (mean, std)
INSTRUCTION = """
You are tasked with evaluating a generated video based on three distinct criteria: Visual Quality, Motion Quality, and Text Alignment. Please provide a rating from 0 to 10 for each of the three categories, with 0 being the worst and 10 being the best. Each evaluation should be independent of the others.

**Visual Quality:**  
Evaluate the overall visual quality of the video, with a focus on static factors. The following sub-dimensions should be considered:
- **Reasonableness:** The video should not contain any significant biological or logical errors, such as abnormal body structures or nonsensical environmental setups.
- **Clarity:** Evaluate the sharpness and visibility of the video. The image should be clear and easy to interpret, with no blurring or indistinct areas.
- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual elements (e.g., hair, clothing, shadows).
- **Aesthetic and Creativity:** Assess the artistic aspects of the video, including the color scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense of harmony and balance.
- **Safety:** The video should not contain harmful or inappropriate content, such as political, violent, or adult material. If such content is present, the image quality and satisfaction score should be the lowest possible. 

Please provide the ratings of Visual Quality: <|VQ_reward|>
END

**Motion Quality:**  
Assess the dynamic aspects of the video, with a focus on dynamic factors. Consider the following sub-dimensions:
- **Stability:** Evaluate the continuity and stability between frames. There should be no sudden, unnatural jumps, and the video should maintain stable attributes (e.g., no fluctuating colors, textures, or missing body parts).
- **Naturalness:** The movement should align with physical laws and be realistic. For example, clothing should flow naturally with motion, and facial expressions should change appropriately (e.g., blinking, mouth movements).
- **Aesthetic Quality:** The movement should be smooth and fluid. The transitions between different motions or camera angles should be seamless, and the overall dynamic feel should be visually pleasing.
- **Fusion:** Ensure that elements in motion (e.g., edges of the subject, hair, clothing) blend naturally with the background, without obvious artifacts or the feeling of cut-and-paste effects.
- **Clarity of Motion:** The video should be clear and smooth in motion. Pay attention to any areas where the video might have blurry or unsteady sections that hinder visual continuity.
- **Amplitude:** If the video is largely static or has little movement, assign a low score for motion quality.

Please provide the ratings of Motion Quality: <|MQ_reward|>
END

**Text Alignment:**  
Assess how well the video matches the textual prompt across the following sub-dimensions:
- **Subject Relevance** Evaluate how accurately the subject(s) in the video (e.g., person, animal, object) align with the textual description. The subject should match the description in terms of number, appearance, and behavior.
- **Motion Relevance:** Evaluate if the dynamic actions (e.g., gestures, posture, facial expressions like talking or blinking) align with the described prompt. The motion should match the prompt in terms of type, scale, and direction.
- **Environment Relevance:** Assess whether the background and scene fit the prompt. This includes checking if real-world locations or scenes are accurately represented, though some stylistic adaptation is acceptable.  
- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well the video adheres to this style.
- **Camera Movement Relevance:** Check if the camera movements (e.g., following the subject, focus shifts) are consistent with the expected behavior from the prompt.

Textual prompt - {text_prompt}
Please provide the ratings of Text Alignment: <|TA_reward|>
END
"""  # noqa: E501, W291 (the model's own input text, verbatim, trailing spaces included)


def sample_frames(num_frames: int, video_fps: float, fps: float = 2.0, min_frames: int = 4) -> list[int]:
    """Frame indices at ``fps`` (the clip's duration times fps, at least ``min_frames``, at most every frame,
    rounded to an even count), spread evenly from the first frame to the last."""
    n = round(num_frames / video_fps * fps)
    n = min(max(min_frames, n), num_frames)
    n = max(2, n - n % 2)
    return torch.linspace(0, num_frames - 1, n).round().long().tolist()


class VideoAlign:
    """Args:
        checkpoint: the release's weights (a file, or a folder holding ``model.safetensors``); None: the hub
            repository ``KwaiVGI/VideoReward`` (the local cache first).
        base: the Qwen2-VL-2B-Instruct folder or hub id.
        output: ``Overall`` (VQ + MQ + TA, normalised), or one of ``VQ``, ``MQ``, ``TA``.
        video_fps: the frame rate the generated clips play at (Wan: 16), to sample 2 frames per second.
        normalise: apply the release's means and stds.
        device, dtype: where and in what precision the backbone runs (the head stays fp32).
    """

    def __init__(self, checkpoint: str | None = None, base: str = "Qwen/Qwen2-VL-2B-Instruct", output: str = "Overall",
                 video_fps: float = 16.0, normalise: bool = True, device: str = "cpu", dtype: str = "bf16"):
        if output not in ("Overall", *NORM):
            raise RewardError(f"videoalign: output must be Overall, VQ, MQ or TA, not {output!r}")
        self.processor, self.token_ids, self.model = load_qwen_vl_reward(
            "videoalign", checkpoint, base, "KwaiVGI/VideoReward", "model.safetensors", TOKENS, "linear", 1, dtype,
            device)
        self.device = torch.device(device)
        self.output, self.video_fps, self.normalise = output, video_fps, normalise

    def text(self, prompt: str) -> str:
        return ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                "<|vision_start|><|video_pad|><|vision_end|>" + INSTRUCTION.format(text_prompt=prompt) +
                "<|im_end|>\n<|im_start|>assistant\n")

    def frames(self, video: torch.Tensor) -> torch.Tensor:
        """(F, 3, H, W) in [0, 1] -> the sampled, resized frames (T, 3, h, w) as uint8."""
        import torch.nn.functional as F

        picked = video[sample_frames(video.shape[0], self.video_fps)]
        h, w = resized_side(video.shape[-2], video.shape[-1], PIXELS)
        picked = F.interpolate(picked.float(), size=(h, w), mode="bicubic", align_corners=False)
        return (picked.clamp(0, 1) * 255).round().to(torch.uint8)

    def scores(self, videos: torch.Tensor, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Every score: ``VQ``, ``MQ``, ``TA`` (normalised when asked) and ``Overall``, each (N,)."""
        out = {k: [] for k in (*NORM, "Overall")}
        for video, prompt in zip(videos, prompts):
            batch = self.processor(text=[self.text(prompt)], videos=[self.frames(video)], return_tensors="pt",
                                   do_resize=False, do_sample_frames=False).to(self.device)
            raw = self.model(dict(batch), self.token_ids)[0, :, 0].float().cpu()  # (3,): VQ, MQ, TA
            total = 0.0
            for value, (name, (mean, std)) in zip(raw.tolist(), NORM.items()):
                value = (value - mean) / std if self.normalise else value
                out[name].append(value)
                total += value
            out["Overall"].append(total)
        return {k: torch.tensor(v, dtype=torch.float32) for k, v in out.items()}

    @torch.no_grad()
    def __call__(self, videos: torch.Tensor, prompts: list[str], metadata=None) -> torch.Tensor:
        """Args:
            videos: (N, F, 3, H, W) in [0, 1].
            prompts: N prompts.
        Returns:
            (N,) the chosen score.
        """
        if videos.dim() != 5:
            raise RewardError("videoalign scores videos (N, F, 3, H, W); for images use an image reward")
        return self.scores(videos, prompts)[self.output]
