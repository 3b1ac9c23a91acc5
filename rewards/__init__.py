"""Reward models and the reward registry (installed as ``flowrl.rewards``).

A reward is a callable ``reward(images, prompts, metadata) -> (N,)`` scores, where images are float
tensors (N, 3, H, W) in [0, 1]. Register one with :func:`register_reward`, name a user function as
``"package.module:function"`` in the config, or install a package whose entry point in the group
``flowrl_rewards`` names it. The built-in rewards import on first use.
"""

from .registry import REWARDS, RewardSet, build_reward, build_reward_set, register_reward

__all__ = ["REWARDS", "RewardSet", "build_reward", "build_reward_set", "register_reward"]
