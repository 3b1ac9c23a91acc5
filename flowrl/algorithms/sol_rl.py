"""Sol-RL (arXiv 2604.06916, "FP4 explore, BF16 train"): DiffusionNFT's forward-process update on samples chosen from
a large candidate pool that is rolled out cheaply. Per prompt, ``sampler.pool.size`` initial noises go through a
cheap ODE rollout (the release: NVFP4, 6 steps, CFG off), the best half and the worst half of ``group_size`` of them
by reward are kept (the release: the top 12 and bottom 12 of 96), and only their noises are regenerated in the
training precision with the rollout's own steps, re-scored, and trained on; the cheap images and rewards choose and
are never trained on. The pool itself is the sampler's (:mod:`flowrl.candidate_pool`), so any method with
independent initial noises can use it; this method is DiffusionNFT with the pool required.
"""

from __future__ import annotations

from ..errors import ConfigError
from .diffusion_nft import DiffusionNFT


class SolRL(DiffusionNFT):
    """DiffusionNFT whose rollout is chosen from a cheap candidate pool: a documented variant of DiffusionNFT."""

    variant_of = DiffusionNFT

    @classmethod
    def check(cls, cfg) -> None:
        pool, group = cfg.sampler.pool, cfg.algorithm.group_size
        if pool.size <= group:
            raise ConfigError(f"sampler.pool.size: sol_rl keeps {group} of a larger pool of candidates per prompt; "
                              f"set it above algorithm.group_size={group} (the release: 96 for 24, four times)")
