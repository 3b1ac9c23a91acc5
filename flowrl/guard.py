"""The reward-hacking guard (``guard.*``): every ``guard.every`` iterations the policy samples a fixed set of
held-out prompts at fixed seeds (ODE, the evaluation grid) and four kinds of signal are measured against their values
at the start of the run:

- **watched rewards**: rewards the run does not train on (``guard.watched``); a fall of more than
  ``guard.watched_tolerance`` standard errors of the starting mean (over the guard's samples) triggers;
- **diversity**: the mean pairwise distance between the embeddings of one prompt's samples (a vision backbone,
  ``guard.diversity_embedder``, such as ``tiny-clip``, else the images downsampled to 32 x 32), averaged over
  prompts (:func:`rewards.embedding.diversity`, which DiverseGRPO logs for its training groups too); a fall to less than
  ``1 - guard.diversity_drop`` of the start triggers;
- **periodic artifacts**: the power of the decoded images' spectrum at the model's patch period (the family's
  pixels per latent patch) and its harmonics over that of the neighbouring frequencies, as a log ratio averaged over
  both axes and the images (0: no peak); a rise of more than ``guard.artifact_rise`` triggers;
- **image drift**: mean brightness, mean saturation and the soft fractions of dark and blown-out pixels (a pixel
  counts fully at gray 0 / 1 and not at all past 0.1 / 0.9, linearly between); a move of more than ``guard.drift``
  (absolute, on a 0..1 scale) triggers.

``guard.on_trigger`` says what a trigger does: ``warn`` (one line, the run goes on), ``stop``, or ``restore_best``
(stop and end the run with the held-out evaluation's best weights where they come no later than the last check at
which every signal held, else that check's weights, kept in checkpoints/guard_ok). Every value is in metrics.jsonl (``guard/...``) and the trackers, and guard.png draws them.
This module measures; :class:`flowrl.callbacks.RewardHackingGuard` runs the checks during training.
"""

from __future__ import annotations

import torch

from .rewards.embedding import diversity, pixel_embeddings  # noqa: F401  (the guard's diversity, shared with methods)


# ------------------------------------------------------------------------------------------ the signals
def frames_of(images: torch.Tensor) -> torch.Tensor:
    """(N, 3, H, W) images or (N, F, 3, H, W) videos -> (M, 3, H, W) float images."""
    return (images.flatten(0, 1) if images.ndim == 5 else images).float()


def periodic_artifact_score(images: torch.Tensor, period: int) -> float:
    """Mean over images and both axes of log(power at the harmonics of ``period`` px / power next to them).

    The grayscale image's spectrum along one axis (averaged over the other) has its harmonics at k = m n / period;
    their summed power is compared with the mean power of the bins 1 and 2 away from each (harmonics excluded) times
    the harmonics' count. A grid or checkerboard at the patch period puts a peak there (a large positive score);
    natural images have a smooth spectrum (about 0). An axis shorter than two periods is skipped.

    Args:
        images: (N, 3, H, W) or (N, F, 3, H, W) in [0, 1].
        period: the pattern's period in pixels (>= 2).
    """
    gray = frames_of(images).mean(1)  # (M, H, W)
    gray = gray - gray.mean((-2, -1), keepdim=True)
    scores = []
    for axis in (-1, -2):
        n = gray.shape[axis]
        if period < 2 or n < 2 * period:
            continue
        power = torch.fft.rfft(gray, dim=axis).abs() ** 2  # (M, H, n // 2 + 1) or (M, n // 2 + 1, W)
        power = power.mean(dim=-2 if axis == -1 else -1)  # (M, n // 2 + 1): averaged over the other axis
        top, f0 = n // 2, n / period
        harmonics = sorted({round(m * f0) for m in range(1, int(top / f0) + 1)})
        near = sorted({h + d for h in harmonics for d in (-2, -1, 1, 2)} - set(harmonics) - {0})
        near = [k for k in near if 0 < k <= top]
        if not harmonics or not near:
            continue
        peak = power[:, harmonics].sum(1)
        background = power[:, near].mean(1) * len(harmonics)
        scores.append(torch.log((peak + 1e-12) / (background + 1e-12)))
    return float(torch.stack(scores).mean()) if scores else 0.0


# Gray levels over which a pixel goes from fully dark (0) to not dark (0.1), and from not blown-out (0.9) to fully
# blown-out (1). A hard threshold turns a flat background that sits near it (a rendered black at 0.059, a white at
# 0.96) into a count that jumps between 0 and the background's whole area when the gray level moves by 0.01; the ramp
# moves the count in proportion to the gray level's move.
EDGE_RAMP = 0.1


def image_drift(images: torch.Tensor) -> dict[str, float]:
    """Mean brightness (gray level), mean saturation (max - min over the channels) and the soft dark and blown-out
    pixel fractions (each pixel weighted 1 at gray 0 / 1, 0 past ``EDGE_RAMP`` from it, linearly between) of
    (N, 3, H, W) or (N, F, 3, H, W) images in [0, 1]."""
    x = frames_of(images).clamp(0, 1)
    gray = x.mean(1)  # (M, H, W)
    dark = ((EDGE_RAMP - gray) / EDGE_RAMP).clamp(0, 1)
    blown = ((gray - (1 - EDGE_RAMP)) / EDGE_RAMP).clamp(0, 1)
    return {"brightness": float(gray.mean()), "saturation": float((x.max(1).values - x.min(1).values).mean()),
            "dark_fraction": float(dark.mean()), "blown_fraction": float(blown.mean())}


DRIFT = ("brightness", "saturation", "dark_fraction", "blown_fraction")


def violations(now: dict, start: dict, g) -> list[str]:
    """One phrase per signal outside its tolerance (empty: every signal held)."""
    out = []
    for name, (value, _) in now.get("watched", {}).items():
        s_value, s_error = start["watched"][name]
        allowed = g.watched_tolerance * max(s_error, 1e-6)
        if s_value - value > allowed:
            out.append(f"watched reward {name} fell {s_value - value:.4g} (from {s_value:.4g} to {value:.4g}; "
                       f"tolerance {allowed:.4g} = {g.watched_tolerance} standard errors of the start)")
    if start["diversity"] > 0 and now["diversity"] < (1 - g.diversity_drop) * start["diversity"]:
        out.append(f"diversity fell to {now['diversity'] / start['diversity']:.0%} of its start ({start['diversity']:.4g} "
                   f"-> {now['diversity']:.4g}; tolerance: {1 - g.diversity_drop:.0%})")
    rise = now["artifacts"] - start["artifacts"]
    if rise > g.artifact_rise:
        out.append(f"periodic artifacts at the {now['period']} px patch period rose by {rise:.3g} (log power ratio "
                   f"{start['artifacts']:.3g} -> {now['artifacts']:.3g}; tolerance {g.artifact_rise})")
    for name in DRIFT:
        move = now[name] - start[name]
        if abs(move) > g.drift:
            out.append(f"{name.replace('_', ' ')} moved {move:+.3f} ({start[name]:.3f} -> {now[name]:.3f}; "
                       f"tolerance {g.drift})")
    return out


def flat(measure: dict) -> dict[str, float]:
    """A measurement as metrics-row entries ``guard/...``."""
    row = {f"guard/{k}": v for k, v in measure.items() if isinstance(v, (int, float)) and k != "period"}
    row.update({f"guard/watched/{name}": v for name, (v, _) in measure.get("watched", {}).items()})
    return row


def check_guard_inputs(cfg) -> None:
    """What the guard will read, checked at setup before a model loads: its prompt set, its watched rewards and a
    local diversity embedder; one line naming the guard's key otherwise."""
    from pathlib import Path

    from .errors import ConfigError, FlowRLError
    from .prompts import prompt_set

    g = cfg.guard
    if not g.enabled or cfg.train.iterations < g.every:
        return
    if g.prompt_set:
        prompt_set(g.prompt_set, "guard.prompt_set")
    if g.watched:
        from .rewards import build_reward_set

        for spec in g.watched:
            if not spec.name:
                raise ConfigError("guard.watched: a watched reward needs a name")
        try:
            build_reward_set(g.watched)
        except FlowRLError as exc:
            raise ConfigError(f"guard.watched: {exc}") from exc
    e = g.diversity_embedder
    if e and (e.startswith((".", "/", "~")) or Path(e).expanduser().exists()) and not Path(e).expanduser().is_dir():
        raise ConfigError(f"guard.diversity_embedder: {e} is not a model folder; give a local folder of a "
                          "transformers image model, or leave it empty for the built-in pixel embedding")
