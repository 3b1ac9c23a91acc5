"""Video rewards: any image reward aggregated over frames, and a temporal-consistency reward.

Videos arrive as (N, F, 3, H, W) floats in [0, 1] (one prompt per video).

- ``video_frames``: scores the chosen frames with an image reward (``reward`` + ``reward_args``) and averages
  them: ``frames="all"`` (mean over every frame), ``"first"`` (DanceGRPO's Wan 2.1 HPS reward), or
  ``"stride"`` (every ``stride``-th frame from 0, Flow-GRPO's video OCR samples every 4th). Frames whose score
  is NaN are left out of the mean; a video with none left scores NaN (masked and counted by the trainer).
- ``temporal_consistency``: the mean cosine similarity of consecutive frames' embeddings from an image
  embedder (``embedder`` + ``embedder_args``; any reward with ``embed_images``, the tiny CLIP by default).
"""

from __future__ import annotations

import torch

from flowrl.errors import RewardError

from .registry import build_reward

FRAME_MODES = ("all", "first", "stride")


def _check_video(reward: str, videos: torch.Tensor) -> None:
    if not isinstance(videos, torch.Tensor) or videos.dim() != 5 or videos.shape[2] != 3:
        shape = tuple(videos.shape) if isinstance(videos, torch.Tensor) else type(videos).__name__
        raise RewardError(f"{reward}: videos must be a float tensor (N, F, 3, H, W) in [0, 1], got {shape}")


def frame_indices(num_frames: int, frames: str, stride: int) -> list[int]:
    if frames == "first":
        return [0]
    if frames == "stride":
        return list(range(0, num_frames, stride))
    return list(range(num_frames))


class VideoFrames:
    accepts_video = True  # scores (N, F, 3, H, W) videos

    def __init__(self, reward: str = "clip", reward_args: dict | None = None, frames: str = "all", stride: int = 4):
        if frames not in FRAME_MODES:
            raise RewardError(f"video_frames: frames {frames!r} must be one of {', '.join(FRAME_MODES)}")
        if stride < 1:
            raise RewardError(f"video_frames: stride must be >= 1, got {stride}")
        self.frames, self.stride = frames, stride
        self.image_reward = build_reward(reward, **(reward_args or {}))

    def __call__(self, videos, prompts, metadata=None):
        _check_video("video_frames", videos)
        n, f = videos.shape[:2]
        idx = frame_indices(f, self.frames, self.stride)
        frames = videos[:, idx].reshape(n * len(idx), *videos.shape[2:])  # (N*K, 3, H, W), video-major
        meta = metadata if metadata is not None else [{} for _ in range(n)]
        scores = torch.as_tensor(self.image_reward(frames, [p for p in prompts for _ in idx],
                                                   [m for m in meta for _ in idx]), dtype=torch.float64)
        if scores.shape != (n * len(idx),):
            raise RewardError(f"video_frames: the frame reward returned shape {tuple(scores.shape)}, "
                              f"expected ({n * len(idx)},)")
        scores = scores.view(n, len(idx))
        ok = torch.isfinite(scores)
        mean = torch.where(ok, scores, 0).sum(1) / ok.sum(1).clamp_min(1)
        return torch.where(ok.any(1), mean, torch.nan).float()

    def __getattr__(self, name):
        # score_with_grad exists exactly when the frame reward passes gradients (reward-gradient methods ask)
        if name == "score_with_grad" and "image_reward" in self.__dict__:
            from .registry import differentiable_scorer

            inner = differentiable_scorer(self.image_reward)
            if inner is not None:
                return lambda videos, prompts, metadata=None: self._mean_with_grad(inner, videos, prompts, metadata)
        raise AttributeError(name)

    def _mean_with_grad(self, inner, videos, prompts, metadata):
        """The frames' mean score (N,) with its graph back to the videos (N, F, 3, H, W)."""
        _check_video("video_frames", videos)
        n, f = videos.shape[:2]
        idx = frame_indices(f, self.frames, self.stride)
        frames = videos[:, idx].reshape(n * len(idx), *videos.shape[2:])
        meta = metadata if metadata is not None else [{} for _ in range(n)]
        scores = inner(frames, [p for p in prompts for _ in idx], [m for m in meta for _ in idx])
        return scores.float().view(n, len(idx)).mean(1)


class TemporalConsistency:
    accepts_video = True

    def __init__(self, embedder: str = "clip", embedder_args: dict | None = None):
        self.embedder = build_reward(embedder, **(embedder_args or {}))
        if not hasattr(self.embedder, "embed_images"):
            raise RewardError(f"temporal_consistency: the embedder {embedder!r} has no embed_images(images); use "
                              "clip, aesthetic, hpsv2 or pickscore")

    @torch.no_grad()
    def __call__(self, videos, prompts=None, metadata=None):
        _check_video("temporal_consistency", videos)
        n, f = videos.shape[:2]
        if f < 2:
            raise RewardError("temporal_consistency: needs videos with at least 2 frames")
        emb = self.embedder.embed_images(videos.reshape(n * f, *videos.shape[2:])).float()
        emb = torch.nn.functional.normalize(emb, dim=-1).view(n, f, -1)  # (N, F, D)
        return (emb[:, 1:] * emb[:, :-1]).sum(-1).mean(1).cpu()  # mean cos of consecutive frames, (N,)
