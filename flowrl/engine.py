"""The denoising-tree rollout engine.

A :class:`~flowrl.samplers.RolloutPlan` is executed breadth-first: all live nodes at one depth go through the
transformer together, in as few calls as ``max_batch`` allows (the anchors call the model once per sample
and step). A parent's velocity serves all its children, so a branching step costs one evaluation per parent.

The result is a :class:`Tree`: per depth d = 0..T the node latents (fp32), each node's prompt (group) index
and parent index; each non-root node has exactly one incoming edge, stored with the node: step index,
exact sigma and sigma_next, old log-prob, transition std, and whether it is SDE / trained.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .samplers import RolloutPlan
from .samplers.kernels import step as kernel_step


@dataclass
class Tree:
    sigmas: torch.Tensor  # (T+1,) the exact grid used
    latents: list[torch.Tensor]  # per depth d: (N_d, C, H, W) fp32
    group: list[torch.Tensor]  # per depth d: (N_d,) long, index of the prompt/group in this batch
    parent: list[torch.Tensor]  # per depth d: (N_d,) long, index into depth d-1 (-1 at d = 0)
    log_prob: list[torch.Tensor]  # per depth d: (N_d,) old log-prob of the edge into each node (0 at d = 0)
    std: list[torch.Tensor]  # per depth d: (N_d,) transition std of the edge into each node (scalar per node)
    plan: RolloutPlan
    nfe: int = 0  # node velocity evaluations (CFG counted once)
    transformer_calls: int = 0
    stats: dict = field(default_factory=dict)

    @property
    def num_steps(self) -> int:
        return len(self.latents) - 1

    @property
    def leaves(self) -> torch.Tensor:
        return self.latents[-1]

    @property
    def leaf_group(self) -> torch.Tensor:
        return self.group[-1]

    def num_edges(self) -> int:
        return sum(x.shape[0] for x in self.latents[1:])

    def node_values_from_leaves(self, leaf_values: torch.Tensor) -> list[torch.Tensor]:
        """Uniform mean of leaf values propagated up the tree: per depth (N_d,) (fusion used for advantages)."""
        values = [None] * (self.num_steps + 1)
        values[-1] = leaf_values.float()
        for d in range(self.num_steps, 0, -1):
            n_up = self.latents[d - 1].shape[0]
            sums = torch.zeros(n_up).index_add_(0, self.parent[d], values[d])
            counts = torch.zeros(n_up).index_add_(0, self.parent[d], torch.ones_like(values[d]))
            values[d - 1] = sums / counts.clamp_min(1)
        return values


def velocity_batched(adapter, x: torch.Tensor, sigma: torch.Tensor, cond, rows: torch.Tensor, max_batch: int,
                     guidance_scale: float, negative) -> tuple[torch.Tensor, int]:
    """Velocities for all nodes, chunked to at most ``max_batch`` per call. Returns ((N, C, H, W), calls)."""
    outs, calls = [], 0
    for start in range(0, x.shape[0], max_batch):
        sl = slice(start, start + max_batch)
        outs.append(adapter.velocity(x[sl], sigma[sl], cond.index(rows[sl]), guidance_scale, negative))
        calls += 1
    return torch.cat(outs), calls


@torch.no_grad()
def rollout(adapter, cond, plan: RolloutPlan, sigmas: torch.Tensor, latent_shape: tuple[int, ...], *,
            kernel: str, noise_level: float, generator: torch.Generator, max_batch: int = 64,
            guidance_scale: float = 1.0, negative=None, log_prob_reduce: str = "mean",
            initial_noise: torch.Tensor | None = None, progress=None) -> Tree:
    """Run ``plan`` for every prompt row of ``cond`` (P prompts) and return the tree.

    Noise is drawn on the CPU from ``generator`` at full depth size, independent of ``max_batch``, so the
    same seed gives the same tree whatever the batching. ``initial_noise`` (P * roots, C, H, W) overrides
    the root draw (used by tests and sample grids).
    """
    device = adapter.device
    num_prompts = cond.embeds.shape[0]
    sigmas = sigmas.float().cpu()
    sigma_at_one = float(sigmas[1])
    n0 = num_prompts * plan.roots_per_prompt
    if initial_noise is None:
        initial_noise = torch.randn((n0, *latent_shape), generator=generator)
    x = initial_noise.float().to(device)
    group = torch.arange(num_prompts).repeat_interleave(plan.roots_per_prompt)
    tree = Tree(sigmas, [x], [group], [torch.full((n0,), -1)], [torch.zeros(n0)], [torch.zeros(n0)], plan)
    for d, spec in enumerate(plan.steps):
        s, s_next = float(sigmas[d]), float(sigmas[d + 1])
        n = x.shape[0]
        v, calls = velocity_batched(adapter, x, torch.full((n,), s, device=device), cond, group.to(device),
                                    max_batch, guidance_scale, negative)
        tree.nfe += n
        tree.transformer_calls += calls
        parent = torch.arange(n).repeat_interleave(spec.branch)
        xp, vp = x[parent.to(device)], v[parent.to(device)]
        if spec.sde:
            noise = torch.randn(xp.shape, generator=generator).to(device)
            level = noise_level if spec.noise_level is None else spec.noise_level
            out = kernel_step(kernel, xp, vp, s, s_next, noise_level=level, sigma_at_one=sigma_at_one,
                              noise=noise, reduce=log_prob_reduce)
            std = out.std.reshape(out.std.shape[0], -1)[:, 0].expand(xp.shape[0]).cpu()
        else:
            out = kernel_step("ode", xp, vp, s, s_next, noise_level=0.0)
            std = torch.zeros(xp.shape[0])
        x = out.sample
        group = group[parent]
        tree.latents.append(x)
        tree.group.append(group)
        tree.parent.append(parent)
        tree.log_prob.append(out.log_prob.float().cpu())
        tree.std.append(std.float())
        if progress is not None:
            progress.update(1)
    return tree
