"""Methods that follow a reward's gradient: ReFL / DRaFT-K (reward backpropagation) and Euphonium (guided
sampling), with the differentiable-reward protocol they share."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_cfg

SHAPES = ["model.pretrained=tiny-shapes", "model.resolution=32", "data.prompt_set=shapes-train"]


def test_non_differentiable_rewards_are_refused_before_work(tmp_path):
    from flowrl.errors import RewardError
    from flowrl.trainer import Trainer

    cfg = make_cfg(tmp_path, "algorithm.name=refl", "rewards[0].name=jpeg_compressibility")
    with pytest.raises(RewardError, match="refl follows the reward's gradient, and jpeg_compressibility passes none"):
        Trainer(cfg)
    assert not (tmp_path / "t").exists()  # refused before the run folder
    cfg = make_cfg(tmp_path, "algorithm.name=euphonium", "sampler.kernel=dance",
                   "algorithm.process_reward=jpeg_compressibility")
    with pytest.raises(RewardError, match="euphonium follows its gradient"):
        Trainer(cfg)


def test_clip_score_with_grad_equals_the_score():
    from flowrl.rewards.clip import ClipScore

    reward = ClipScore()
    images = torch.rand(2, 3, 32, 32, requires_grad=True)
    prompts = ["a red circle on a blue background", "a green square on a white background"]
    scored = reward.score_with_grad(images, prompts)
    assert torch.allclose(scored.detach().cpu(), reward(images.detach(), prompts), atol=1e-6)
    scored.sum().backward()
    assert images.grad is not None and float(images.grad.abs().sum()) > 0


def test_refl_raises_the_reward_it_differentiates(tmp_path):
    from flowrl.trainer import Trainer

    cfg = make_cfg(tmp_path, "algorithm.name=refl", "algorithm.grad_steps=2", "sampler.num_steps=4",
                   "train.prompts_per_iter=4", "rewards=[{name: 'tests.helpers:brightness'}]", "train.lr=1e-2",
                   *SHAPES)
    trainer = Trainer(cfg)
    # the objective reads the prompts and the rewards from the update batch and its parts, not the algorithm
    trainer.algorithm.remember_prompts, trainer.algorithm.rewards = (lambda *args: None), None
    prompts, seeds = ["a red circle on a blue background"] * 4, [0, 1, 2, 3]
    before = trainer.rollout_sampler(prompts, seeds).mean()
    rows = [trainer.iteration(i) for i in range(3)]
    assert rows[0]["refl_rerun_gap"] < 1e-5  # the re-run from the stored state reproduces the rollout's samples
    assert rows[0]["reward_grad_mean"] == pytest.approx(rows[0]["reward_mean/total"], abs=1e-5)
    assert rows[0]["nfe_train"] == 4 * 2  # four samples x two re-run steps
    after = trainer.rollout_sampler(prompts, seeds).mean()
    assert after > before + 1e-3, (before, after)


def test_refl_mode_predicts_x0_from_a_late_step_and_pays_the_margin(tmp_path):
    """ImageReward's ReFL: every sample stops at a step drawn from the grid's last quarter (indices 6..7 of 8), the
    loss row is scale * relu(margin - r(decode(x_t - sigma v))); with the margin above every reward it is
    scale * (margin - mean r) exactly, and the weights move toward a higher reward."""
    from flowrl.trainer import Trainer

    cfg = make_cfg(tmp_path, "algorithm.name=refl", "algorithm.mode=refl", "algorithm.refl_margin=5.0",
                   "algorithm.refl_scale=10.0", "sampler.num_steps=8", "train.prompts_per_iter=4",
                   "rewards=[{name: 'tests.helpers:brightness'}]", "train.lr=1e-2", *SHAPES)
    trainer = Trainer(cfg)
    prompts, seeds = ["a red circle on a blue background"] * 4, [0, 1, 2, 3]
    before = trainer.rollout_sampler(prompts, seeds).mean()
    rows = [trainer.iteration(i) for i in range(3)]
    stops = trainer.objective.stops
    assert set(stops.tolist()) <= {6, 7} and rows[0]["nfe_train"] == 4  # one prediction per sample
    assert rows[0]["policy_loss"] == pytest.approx(10.0 * (5.0 - rows[0]["reward_grad_mean"]), rel=1e-5)
    assert "refl_rerun_gap" not in rows[0]
    after = trainer.rollout_sampler(prompts, seeds).mean()
    assert after > before + 1e-3, (before, after)


def test_guided_step_by_hand():
    """One guided Dance-SDE step: the sample is the unguided one plus the guidance's shift, and its log-prob is
    that of the unguided transition."""
    from flowrl.engine import rollout_rounds
    from flowrl.samplers import RolloutPlan, StepSpec
    from flowrl.samplers.kernels import step as kernel_step

    shift = torch.full((1, 2, 2), 0.05)

    def guidance(x, v, s, s_next, rows):
        return shift.expand_as(x), torch.arange(len(x), dtype=torch.float32)

    def run(plan):
        gen = rollout_rounds(2, "cpu", plan, torch.tensor([1.0, 0.5, 0.0]), (1, 2, 2), kernel="dance",
                             noise_level=0.5, generator=torch.Generator().manual_seed(0))
        x, sig, rows = next(gen)
        try:
            while True:
                x, sig, rows = gen.send(torch.ones_like(x))
        except StopIteration as done:
            return done.value

    steps = [StepSpec(sde=True, trained=True, guided=True), StepSpec(sde=False)]
    guided = run(RolloutPlan(steps, guidance=guidance))
    plain = run(RolloutPlan([StepSpec(sde=True, trained=True), StepSpec(sde=False)]))
    assert torch.allclose(guided.latents[1], plain.latents[1] + 0.05)
    x0 = plain.latents[0]
    expect = kernel_step("dance", x0, torch.ones_like(x0), torch.tensor(1.0), torch.tensor(0.5), noise_level=0.5,
                         prev_sample=guided.latents[1]).log_prob
    assert torch.allclose(guided.log_prob[1], expect)
    assert guided.rounds[1].process_reward.tolist() == [0.0, 1.0] and guided.rounds[2].process_reward.tolist() == [0, 0]


def guided_pixel_step(*overrides):
    """Euphonium (lambda 2, the mean-pixel process reward) on the pixel-space tiny model: one guided step of 2
    latents x = 0.1, v = 0.2 from sigma 0.8 to 0.6. Returns (algorithm, shift, process reward)."""
    from flowrl.algorithms.euphonium import Euphonium
    from flowrl.config import load_config
    from flowrl.models import load_adapter

    cfg = load_config(None, ["algorithm.name=euphonium", "sampler.kernel=dance", "algorithm.guidance_scale=2.0",
                             "algorithm.process_reward=tests.helpers:brightness", *SHAPES, *overrides])
    algo = Euphonium(cfg)
    algo.check_inputs(None)
    algo.adapter = load_adapter(cfg.model)
    algo.prompts, algo.metadata = ["a red circle on a blue background"], None
    x, v = torch.full((2, 3, 32, 32), 0.1), torch.full((2, 3, 32, 32), 0.2)
    shift, process = algo.guide(x, v, 0.8, 0.6, torch.tensor([0, 0]))
    return algo, shift, process


def test_euphonium_guidance_by_hand():
    """Pixel-space model (decode = x / 2 + 1/2) and the mean-pixel reward: g = 1 / (2 n) on every element, so the
    shift is lambda (sigma - sigma_next) / (2 n)."""
    from flowrl.algorithms.euphonium import process_advantages

    algo, shift, process = guided_pixel_step()
    n = 3 * 32 * 32
    assert torch.allclose(shift, torch.full_like(shift, 2.0 * 0.2 / (2 * n)))
    assert process.tolist() == pytest.approx([(0.1 - 0.8 * 0.2) / 2 + 0.5] * 2)
    # the process advantage: a z-score with torch's std (+ 1e-8) per group
    pra = process_advantages(torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0]), torch.tensor([0, 0, 0, 1, 1]))
    assert pra.tolist() == pytest.approx([-1.0, 0.0, 1.0, 0.0, 0.0], abs=1e-6)
    assert algo.first_guided == 10 - 2  # the last quarter of 10 steps (at least one)


def test_euphonium_iteration_adds_process_advantages(tmp_path):
    from flowrl.trainer import Trainer

    cfg = make_cfg(tmp_path, "algorithm.name=euphonium", "sampler.kernel=dance", "sampler.num_steps=6",
                   "algorithm.guidance_start=3", "algorithm.group_size=4", "train.prompts_per_iter=2",
                   "rewards=[{name: shapes}]", "algorithm.process_reward=clip", *SHAPES)
    row = Trainer(cfg).iteration(0)
    assert row["ratio_max_abs_dev_first_update"] < 1e-5  # the stored log-prob is the unguided transition's
    assert row["guided_edges"] == 3 * 8  # steps 3, 4, 5 x eight samples
    assert 0 < row["process_reward/step3"] < 1


def test_euphonium_latent_process_reward_by_hand():
    """A latent reward model is differentiated at the noisy state itself: r = -mean(x^2) gives g = -2 x / n."""
    from flowrl.algorithms.euphonium import Euphonium
    from flowrl.config import load_config

    cfg = load_config(None, ["algorithm.name=euphonium", "sampler.kernel=dance", "algorithm.guidance_scale=1.0",
                             "algorithm.process_reward=tests.helpers:latent_energy",
                             "algorithm.process_reward_space=latent"])
    algo = Euphonium(cfg)
    algo.check_inputs(None)
    algo.prompts, algo.metadata = ["a cat", "a dog"], None
    x = torch.randn(2, 4, 2, 2)
    shift, process = algo.guide(x, torch.zeros_like(x), 0.5, 0.25, torch.tensor([0, 1]))
    assert torch.allclose(shift, 0.25 * (-2 * x / 16), atol=1e-7)
    assert torch.allclose(process, -(x ** 2).flatten(1).mean(1))
