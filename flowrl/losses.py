"""Policy-gradient losses on per-edge log-probs."""

from __future__ import annotations

import torch


def ppo_clip_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                  clip_range: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-edge clipped surrogate ``max(-A r, -A clip(r, 1 - eps, 1 + eps))`` with ``r = exp(logp - logp_old)``.

    All inputs are (E,); returns (loss (E,), ratio (E,)).
    """
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.maximum(unclipped, clipped), ratio


def gaussian_kl_same_std(mean: torch.Tensor, mean_ref: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL(N(mean, s^2) || N(mean_ref, s^2)) per element averaged over non-batch dims -> (E,).

    ``std`` is the transition's full std (including sqrt(|dt|)) by default; :func:`kl_std` gives Flow-GRPO's
    SD3 normalisation, which omits the dt factor (discussed in flow_grpo's GitHub thread #78), so its beta is |dt| times ours.
    """
    kl = (mean - mean_ref) ** 2 / (2 * std**2)
    return kl.mean(dim=tuple(range(1, kl.ndim)))


def kl_std(mode: str, std: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor) -> torch.Tensor:
    """The std the KL divides by: ``transition`` = the full transition std; ``flow_grpo`` = the std without its
    sqrt(|dt|) factor (Flow-GRPO's form, so published beta values carry over). sigma, sigma_next: (B,)."""
    if mode == "transition":
        return std
    dt = (sigma - sigma_next).abs().float().reshape(-1, *([1] * (std.ndim - 1)))
    return std / dt.sqrt()


def guard_log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor, mean: torch.Tensor, old_mean: torch.Tensor,
                    std: torch.Tensor) -> torch.Tensor:
    """GRPO-Guard's normalised log-ratio per edge (E,): ``(logp - logp_old + bias) * s`` with
    ``bias = mean((mu - mu_old)^2) / (2 s^2)`` and ``s`` the edge's transition std.

    With the sample ``x' = mu_old + s eps`` and per-element-mean log-probs this equals ``mean((mu - mu_old) eps)``:
    centred at 0 whatever the step, where the plain log-ratio is biased below 0 by ``bias`` (most at low noise).
    ``bias`` is per edge here (the maths' form); GRPO-Guard's released script reduces it over the batch.
    mean, old_mean: (E, *latent); std: (E, *latent) or broadcastable; log-probs (E,).
    """
    n = mean.shape[0]
    s = std.expand_as(mean).reshape(n, -1).mean(1)  # (E,) the transition std (one value per edge for Flow-SDE)
    bias = ((mean - old_mean) ** 2).reshape(n, -1).mean(1) / (2 * s**2)
    return (log_prob - old_log_prob + bias) * s


def edge_objective(x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor,
                   prev: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                   v_ref: torch.Tensor | None, *, kernel: str, noise_level: float, sigma_at_one: float,
                   clip_range: float, reduce: str = "mean", kl_std_mode: str = "transition",
                   kernel_options: dict | None = None):
    """One edge batch's whole training objective: the log-prob of the taken step ``prev`` under the policy's
    transition from ``x`` with velocity ``v``, the ratio to ``old_log_prob``, the clipped surrogate and the KL to the
    reference transition (velocity ``v_ref``; zeros when None). x, v, prev, v_ref: (E, *latent); the rest (E,).

    Written as one function so that ``torch.compile`` fuses it (:func:`compiled_edge_objective`): the eager path
    materialises several latent-sized temporaries per edge. Returns (loss (E,), ratio (E,), log_prob (E,), kl (E,)).
    """
    from .samplers.kernels import step as kernel_step

    out = kernel_step(kernel, x, v, sigma, sigma_next, noise_level=noise_level, sigma_at_one=sigma_at_one,
                      prev_sample=prev, reduce=reduce, **(kernel_options or {}))
    loss, ratio = ppo_clip_loss(out.log_prob, old_log_prob, advantages, clip_range)
    if v_ref is None:
        kl = torch.zeros_like(loss)
    else:
        ref = kernel_step(kernel, x, v_ref, sigma, sigma_next, noise_level=noise_level, sigma_at_one=sigma_at_one,
                          prev_sample=prev, **(kernel_options or {}))
        kl = gaussian_kl_same_std(out.mean, ref.mean, kl_std(kl_std_mode, out.std, sigma, sigma_next))
    return loss, ratio, out.log_prob, kl


_COMPILED = {}


def compiled_edge_objective():
    """:func:`edge_objective` under ``torch.compile`` (inductor; dynamic edge counts), built once per process."""
    if "edge" not in _COMPILED:
        _COMPILED["edge"] = torch.compile(edge_objective, dynamic=True)
    return _COMPILED["edge"]


def divergence_masked_loss(log_ratio: torch.Tensor, adv: torch.Tensor, divergence: torch.Tensor,
                           threshold: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flow-DPPO's per-edge loss: ``-A r``, except for the edges whose move both left the trust region
    (``divergence >= threshold``) and went the way the advantage pushes (r > 1 with A > 0, r < 1 with A < 0);
    those contribute 0. No clip.

    Args:
        log_ratio: (E,) log(pi_theta / pi_old) per edge.
        adv: (E,) advantages.
        divergence: (E,) KL of the current transition from the rollout's (detached).
        threshold: the trust region's size.
    Returns:
        ``(loss (E,), ratio (E,), dropped (E,) bool)``.
    """
    ratio = torch.exp(log_ratio)
    pushes_on = ((ratio > 1) & (adv > 0)) | ((ratio < 1) & (adv < 0))
    dropped = (divergence >= threshold) & pushes_on
    return -adv * ratio * (~dropped), ratio, dropped


def transition_divergence(mean: torch.Tensor, mean_old: torch.Tensor, std: torch.Tensor | None) -> torch.Tensor:
    """The per-element-mean Gaussian KL between two transitions that share their std: ``mean((mu - mu_old)^2) /
    (2 s^2)`` per row; ``std=None`` takes s = 1.

    Args:
        mean, mean_old: (E, *latent) the transitions' means.
        std: the transition std, broadcastable to (E, *latent) (one value per row), or None.
    Returns:
        (E,) divergences.
    """
    sq = (mean - mean_old) ** 2
    if std is not None:
        sq = sq / (2 * std ** 2)
    else:
        sq = sq / 2
    return sq.flatten(1).mean(1)


def delight_gated_loss(log_ratio: torch.Tensor, log_prob: torch.Tensor, adv: torch.Tensor, eta: float = 1.0,
                       clip: float = 10.0, surprisal: str = "centred") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Delightful Policy Gradient's per-edge loss: ``-sg(w A) log pi`` with the gate
    ``w = sigmoid(chi / eta)``, ``chi = A l``, and the surprisal ``l = -log pi`` clipped to ``[-clip, clip]``. No ratio
    and no clip; the gradient equals that of ``-w A log(pi / pi_old)``, which is what is returned, so the value is 0
    on the first update.

    ``surprisal``: ``raw`` uses the per-element-mean log-prob as it is. With Gaussian transitions it is nearly a
    constant per step (its sample-dependent part has std about 0.7 / sqrt(latent size)), so the gate then reweights
    by (advantage, step) only. ``centred`` (the default) subtracts the batch's mean surprisal and divides by its std,
    so the gate sees which actions are unusual among those sampled.

    Args:
        log_ratio: (E,) log(pi_theta / pi_old) per edge.
        log_prob: (E,) log pi_theta (mean over elements).
        adv: (E,) advantages.
        eta: the gate's temperature (the paper: 1).
        clip: the surprisal's bound (the paper's algorithm: 10).
        surprisal: ``centred`` or ``raw``.
    Returns:
        ``(loss (E,), ratio (E,), gate (E,))``.
    """
    lp = log_prob.detach()
    l = -lp
    if surprisal == "centred" and l.numel() > 1:
        l = (l - l.mean()) / (l.std(correction=0) + 1e-8)
    l = l.clamp(-clip, clip)
    gate = torch.sigmoid(adv * l / eta)
    return -(gate * adv).detach() * log_ratio, torch.exp(log_ratio.detach()), gate


def dpo_loss(err_w: torch.Tensor, err_ref_w: torch.Tensor, err_l: torch.Tensor, err_ref_l: torch.Tensor,
             beta: float) -> torch.Tensor:
    """Diffusion-DPO per pair (P,): ``-log sigmoid(-(beta / 2) ((e_w - e_ref_w) - (e_l - e_ref_l)))`` with e the
    flow-matching errors of the policy and the reference on the chosen (w) and rejected (l) samples."""
    return -torch.nn.functional.logsigmoid(-(beta / 2) * ((err_w - err_ref_w) - (err_l - err_ref_l)))


def group_preference_loss(err: torch.Tensor, err_ref: torch.Tensor, adv: torch.Tensor, beta: float) -> torch.Tensor:
    """DGPO's rows for one group of K samples (K,): ``sigmoid(S) A_i e_i`` with the detached group score
    ``S = (beta / K) sum_i A_i (e_i - e_ref_i)``; e, e_ref the flow-matching errors of the policy and the
    reference at the group's shared (sigma, noise), A the advantages. Its gradient is that of the group preference
    ``-log sigmoid(-S)`` up to the factor beta / K: lowering the error of the samples with A > 0 (raising it for
    A < 0), less so once the group already prefers them relative to the reference."""
    score = (beta / err.shape[0]) * (adv * (err - err_ref)).sum()
    return torch.sigmoid(score.detach()) * adv * err


def dsm_clip(err: torch.Tensor, err_old: torch.Tensor, adv: torch.Tensor, clip_range: float) -> torch.Tensor:
    """DGPO's clip on the denoising (flow-matching) ratio ``rho = exp(e_old - e)`` per sample (K,) bool: True where
    the sample has already moved far enough in its advantage's direction (A > 0 and rho > 1 + c, or A < 0 and
    rho < 1 - c), so its error enters the loss detached."""
    rho = torch.exp(err_old - err.detach())
    return ((adv > 0) & (rho > 1 + clip_range)) | ((adv < 0) & (rho < 1 - clip_range))
