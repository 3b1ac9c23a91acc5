"""User-style reward functions referenced as ``tests.helpers:function`` in tests, and shared test drivers."""

import torch
from flowrl.samplers import RolloutPlan, StepSpec

from flowrl.engine import Round, Tree


def wrong_shape(images, prompts, metadata):
    return torch.zeros(images.shape[0], 2)


def half_nan(images, prompts, metadata):
    out = torch.ones(images.shape[0])
    out[::2] = float("nan")
    return out


def brightness(images, prompts, metadata):
    return images.mean(dim=(1, 2, 3))


brightness.differentiable = True  # the mean keeps the graph: reward backpropagation and guidance can use it


def video_brightness(images, prompts, metadata):
    """Videos (N, F, 3, H, W) -> their mean pixel (N,), differentiable."""
    return images.flatten(1).mean(1)


video_brightness.differentiable = True
video_brightness.accepts_video = True


def per_prompt_constant(images, prompts, metadata):
    """Equal within every group, different between prompts: every group has zero variance."""
    return torch.tensor([float(len(p) % 3) for p in prompts])


def slow_brightness(images, prompts, metadata):
    """A scorer that takes a while (a remote or large model stands behind it)."""
    import time

    time.sleep(0.3)
    return images.mean(dim=(1, 2, 3))


# ---------------------------------------------------------------- a user's algorithm, plugged in by name

from flowrl.algorithms import TransitionAlgorithm, TransitionOptions  # noqa: E402
from flowrl.config import opt  # noqa: E402
from flowrl.errors import ConfigError  # noqa: E402


class EveryOtherStepOptions(TransitionOptions):
    stride: int = opt(2, "train every stride-th step", lo=1)


class EveryOtherStep(TransitionAlgorithm):
    """Flow-GRPO that trains steps 0, stride, 2 stride, ... (``algorithm.name: tests.helpers:EveryOtherStep``)."""

    Options = EveryOtherStepOptions

    @classmethod
    def check(cls, cfg):
        if cfg.algorithm.stride >= cfg.sampler.num_steps:
            raise ConfigError(f"algorithm.stride: {cfg.algorithm.stride} leaves no trained step after step 0")

    def trained_steps(self, t):
        return [i % self.opts.stride == 0 for i in range(t)]


# ---------------------------------------------------------------- user rewards that misbehave
def raises(images, prompts, metadata):
    raise ValueError("the scorer's model is not loaded")


def returns_text(images, prompts, metadata):
    return "good"


def returns_none(images, prompts, metadata):
    return None


class ScriptedCurve:
    """A held-out evaluator whose ``all`` follows a script, one value per curve point (best-checkpoint logic);
    it still samples, so the weights it saw are the ones the trainer keeps."""

    SCRIPT = [0.5, 0.6, 0.8, 0.7, 0.4, 0.3]
    headline = "all"  # the number the held-out curve maximises (log.best_metric's default)

    def __init__(self):
        self.calls = 0

    def __call__(self, sampler, seeds, grid=False):
        images = sampler(["a red circle on a blue background"], seeds[:1])
        value = self.SCRIPT[min(self.calls, len(self.SCRIPT) - 1)]
        self.calls += not grid  # the curve points follow the script; the before / after evaluations do not move it
        result = {"all": value, "mean_pixel": float(images.mean())}
        return (result, images, ["a red circle on a blue background"]) if grid else result


class TiedCurve(ScriptedCurve):
    """The last curve point ties the best one."""

    SCRIPT = [0.5, 0.8, 0.6, 0.8]


def run_shipped_job(config_name: str, out_dir) -> tuple:
    """A shipped main job exactly as configured (its output under ``out_dir``, no progress bars, no periodic
    checkpoints): (run directory, its eval.json as a dict)."""
    import json
    from pathlib import Path

    from flowrl.config import load_config
    from flowrl.trainer import Trainer

    root = Path(__file__).resolve().parent.parent
    cfg = load_config(root / "configs" / config_name,
                      [f"log.output_dir={out_dir}", "log.run_name=slow", "log.progress=false", "log.save_every=0"])
    trainer = Trainer(cfg)
    trainer.train()
    return trainer.run_dir, json.loads((trainer.run_dir / "eval.json").read_text())


class FailsOnSecondCall:
    """A reward that scores once, then fails (a reward server that goes away mid-run)."""

    calls = 0

    def __call__(self, images, prompts, metadata):
        type(self).calls += 1
        if type(self).calls > 1:
            raise RuntimeError("the reward went away")
        return images.mean(dim=tuple(range(1, images.ndim)))


def latent_energy(latents, sigma, prompts):
    """A latent process reward: minus the mean square of the noisy latent (its gradient is -2 x / n)."""
    return -(latents.float() ** 2).flatten(1).mean(1)


class NaNCurve(ScriptedCurve):
    """An evaluator whose numbers are NaN at every point (a broken metric)."""

    SCRIPT = [float("nan")]


def tree_skeleton(parents: list[list[int]], log_probs: list[list[float]] | None = None,
             groups: list[int] | None = None) -> Tree:
    """A latent-free tree from its structure, for hand-computed checks: ``parents[r - 1]`` lists the parent
    (position in round r - 1) of every node of round r; every node of the last round is a leaf; all edges
    are SDE and trained. ``groups`` gives each root's prompt row (default: all 0)."""
    n0 = len(groups) if groups else 1 + max(parents[0], default=0)
    t = len(parents)
    lps = [[0.0] * n0] + (log_probs or [[0.0] * len(p) for p in parents])
    rounds = []
    for r, par in enumerate([[-1] * n0] + parents):
        k = len(par)
        par = torch.tensor(par)
        root = torch.arange(n0) if r == 0 else rounds[r - 1].root[par]
        group = torch.tensor(groups or [0] * n0) if r == 0 else rounds[r - 1].group[par]
        rounds.append(Round(torch.zeros(k, 1), torch.full((k,), r), group, root, torch.full((k,), -1), par,
                            torch.tensor(lps[r], dtype=torch.float32), torch.zeros(k), torch.zeros(k),
                            torch.ones(k, dtype=torch.bool), torch.ones(k, dtype=torch.bool),
                            torch.zeros(k, dtype=torch.long)))
    return Tree(torch.linspace(1, 0, t + 1), rounds, RolloutPlan([StepSpec() for _ in range(t)], roots_per_prompt=n0))
