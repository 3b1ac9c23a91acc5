"""Reward models and the reward registry (installed as ``flowrl.rewards``).

A reward is a callable ``reward(images, prompts, metadata) -> (N,)`` scores, where images are float
tensors (N, 3, H, W) in [0, 1]. Register one with :func:`register_reward`, or name a user function as
``"package.module:function"`` in the config.
"""

from . import aesthetic, clip, geneval, hpsv2, hpsv3, imagereward, jpeg, ocr, pickscore, remote, video, videoalign, vlm_judge  # noqa: F401 (they register)
from .registry import REWARDS, RewardSet, build_reward, build_reward_set, register_reward

__all__ = ["REWARDS", "RewardSet", "build_reward", "build_reward_set", "register_reward"]
