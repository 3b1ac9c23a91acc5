"""Advantage rules: leaf rewards -> per-leaf advantages -> per-edge advantages.

Group z-score (GRPO): ``A = (r - mean_g) / (std + eps)``, where std is the group's own (``std=group``) or
the whole batch's (``std=global``), biased (ddof 0, Flow-GRPO) or unbiased (ddof 1, DanceGRPO), then clipped
to +-clip. A group whose reward std is below ``zero_std_threshold`` gives zero advantage (never NaN) and is
counted in ``zero_std_ratio``. Non-finite rewards are masked: those leaves get zero advantage and are left
out of every statistic.
"""

from __future__ import annotations

import torch


def _std(values: torch.Tensor, ddof: int) -> torch.Tensor:
    n = values.numel()
    if n - ddof <= 0:
        return torch.zeros((), dtype=values.dtype)
    return values.var(correction=ddof).sqrt()


def group_advantages(rewards: torch.Tensor, groups: torch.Tensor, adv_cfg,
                     baselines: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """rewards (L,), groups (L,) long -> advantages (L,) fp32 and statistics.

    Zero-variance groups follow ``adv_cfg.zero_variance``: ``zero`` (and ``drop_refill``, which the trainer
    handles) give 0; ``global`` gives (r - batch mean) / batch std; ``tracker`` gives (r - baseline) / batch
    std with ``baselines`` (L,) in reward units (a per-prompt tracker's value).
    """
    rewards = rewards.double()
    valid = torch.isfinite(rewards)
    adv = torch.zeros_like(rewards)
    group_ids = torch.unique(groups)
    global_std = _std(rewards[valid], adv_cfg.ddof) if valid.any() else torch.zeros((), dtype=rewards.dtype)
    global_mean = rewards[valid].mean() if valid.any() else torch.zeros((), dtype=rewards.dtype)
    policy = getattr(adv_cfg, "zero_variance", "zero")
    zero_groups = rescued = 0
    group_stds = []
    for g in group_ids.tolist():
        member = (groups == g) & valid
        r = rewards[member]
        if r.numel() == 0:
            zero_groups += 1
            continue
        g_std = _std(r, adv_cfg.ddof)
        group_stds.append(float(g_std))
        if r.numel() < 2 or g_std < adv_cfg.zero_std_threshold:
            zero_groups += 1
            if policy == "global" and global_std > adv_cfg.zero_std_threshold:
                adv[member] = (r - global_mean) / (global_std + adv_cfg.eps)
                rescued += 1
            elif policy == "tracker" and baselines is not None and global_std > adv_cfg.zero_std_threshold:
                adv[member] = (r - baselines.double()[member]) / (global_std + adv_cfg.eps)
                rescued += 1
            continue
        scale = g_std if adv_cfg.std == "group" else global_std
        adv[member] = (r - r.mean()) / (scale + adv_cfg.eps)
    adv = adv.clamp(-adv_cfg.clip, adv_cfg.clip).float()
    stats = {
        "zero_std_ratio": zero_groups / max(len(group_ids), 1),
        "zero_std_groups": zero_groups,
        "zero_std_groups_given_advantage": rescued,
        "reward_nan_count": int((~valid).sum()),
        "group_std_mean": sum(group_stds) / max(len(group_stds), 1),
        "advantage_abs_mean": float(adv.abs().mean()),
    }
    return adv, stats
