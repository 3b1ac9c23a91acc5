"""flowrl: GRPO-style reinforcement learning for flow-matching image and video models.

Every published variant (Flow-GRPO, DanceGRPO, MixGRPO, BranchGRPO, ...) is a preset of one denoising-tree
rollout engine plus an advantage rule and a loss rule.
"""

__version__ = "0.1.0"
