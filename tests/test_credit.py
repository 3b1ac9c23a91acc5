"""The ground-truth credit estimator (flowrl/credit.py) on hand-made dynamics whose true credit is known, and the
comparison it reports, then `flowrl credit` on the tiny model.

The hand-made dynamics: a latent with one channel per denoising step; step i adds its noise to channel i only
(ODE steps add nothing). A reward that reads channel 0 depends only on step 0's noise, so the true advantage of
step 0's action is exactly that action's channel-0 value and every later action's is 0."""

import math
from pathlib import Path

import pytest
import torch

from flowrl.cli import main
from flowrl.credit import (Transition, agreement, noise_table, pearson, run_continuations, spearman,
                           true_advantages)
from flowrl.engine import Round, Tree
from flowrl.samplers import RolloutPlan, StepSpec

ROOT = Path(__file__).resolve().parent.parent
T = 4  # steps
SHAPE = (T, 1, 1)  # one channel per step


def channel_stepper(x, rows, sigma_from, sigma_to, sde, level, noise):
    """Step i (read from sigma: sigmas are linspace(1, 0)) writes its noise into channel i."""
    out = x.clone()
    index = torch.round((1 - sigma_from) * T).long()
    for n in range(x.shape[0]):
        if sde[n]:
            out[n, index[n]] += noise[n, index[n]]
    return out


def chain_tree(actions: torch.Tensor) -> Tree:
    """K trajectories of T SDE steps (one prompt): the latent after step i holds actions[k, :i + 1] in its
    first channels."""
    k = actions.shape[0]
    rounds = []
    for r in range(T + 1):
        lat = torch.zeros(k, *SHAPE)
        lat[:, :r, 0, 0] = actions[:, :r]
        parent = torch.arange(k) if r else torch.full((k,), -1)
        rounds.append(Round(lat, torch.full((k,), r), torch.zeros(k, dtype=torch.long), torch.arange(k),
                            torch.full((k,), -1), parent, torch.zeros(k), torch.ones(k), torch.full((k,), 0.7),
                            torch.full((k,), r > 0), torch.full((k,), r > 0), torch.zeros(k, dtype=torch.long)))
    plan = RolloutPlan([StepSpec(sde=True, trained=True) for _ in range(T)], roots_per_prompt=k)
    return Tree(torch.linspace(1, 0, T + 1), rounds, plan)


def every_transition(tree, adv=None) -> list:
    k = tree.latents[0].shape[0]
    return [Transition(r, n, n, r - 1, 0, 0.0 if adv is None else float(adv[r][n]))
            for r in range(1, T + 1) for n in range(k)]


def test_a_reward_of_step_0s_noise_puts_all_credit_at_step_0():
    actions = torch.randn(6, T, generator=torch.Generator().manual_seed(3))
    tree = chain_tree(actions)
    transitions = every_transition(tree)
    noise = noise_table(1, 8, T, SHAPE, seed=5)
    truth = true_advantages(tree, transitions, channel_stepper, lambda x, rows: x[:, 0, 0, 0], noise, 0.7)
    value = truth.value.reshape(T, 6)  # (step, trajectory)
    # step 0: Q = the action's channel 0, V(root) = the mean of the continuations' channel-0 draws, which are
    # antithetic pairs: exactly 0
    assert torch.allclose(value[0], actions[:, 0].double(), atol=1e-6)
    assert torch.all(value[1:] == 0) and torch.all(truth.se[6:] == 0)  # later steps: none, with no error
    # the Monte Carlo cost: a root's 8 continuations of 4 steps, a state at step i's 8 of 4 - i, leaves free
    assert truth.evaluations == 6 * 8 * (4 + 3 + 2 + 1)


def test_a_reward_independent_of_the_sample_has_zero_truth_and_no_error():
    tree = chain_tree(torch.randn(4, T))
    truth = true_advantages(tree, every_transition(tree), channel_stepper,
                            lambda x, rows: torch.full((x.shape[0],), 0.37), noise_table(1, 4, T, SHAPE, 0), 0.7)
    assert torch.all(truth.value == 0) and torch.all(truth.se == 0)


def test_common_noise_makes_the_paired_error_smaller_than_independent_values():
    """Reward = sum of all channels: step i's truth is its action (later noise cancels in the paired difference);
    with independent continuations the difference would carry the later steps' variance."""
    actions = torch.randn(5, T, generator=torch.Generator().manual_seed(1))
    tree = chain_tree(actions)
    noise = noise_table(1, 6, T, SHAPE, 2, antithetic=False)
    truth = true_advantages(tree, every_transition(tree), channel_stepper, lambda x, rows: x.sum((1, 2, 3)), noise,
                            0.7)
    value = truth.value.reshape(T, 5)
    draws = noise[0, :, :, :, 0, 0]  # (M, T, T): continuation k's draw at step i, channel i
    for i in range(T):  # Q - V = action - mean_k(draw of step i): exact, whatever the later draws
        expected = actions[:, i].double() - draws[:, i, i].double().mean()
        assert torch.allclose(value[i], expected, atol=1e-5)


def test_the_comparison_golden_values():
    truth = torch.tensor([0.3, -0.1, 0.2, -0.4, 0.05], dtype=torch.float64)
    se = torch.tensor([0.01, 0.01, 0.01, 0.01, 0.1], dtype=torch.float64)
    steps = torch.tensor([0, 0, 1, 1, 1])
    a = agreement(2 * truth + 1, truth, se, steps)  # the truth itself, rescaled: a perfect method
    assert a.pearson == pytest.approx(1) and a.spearman == pytest.approx(1) and a.sign == 0.5  # +1: all positive
    a = agreement(truth, truth, se, steps)
    assert (a.pearson, a.spearman, a.sign, a.explained) == (pytest.approx(1), pytest.approx(1), 1.0, pytest.approx(1))
    assert a.per_step[1]["transitions"] == 3 and a.per_step[0]["pearson"] == pytest.approx(1)
    flat = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0], dtype=torch.float64)
    # by hand: Pearson of flat with truth
    t, f = truth - truth.mean(), flat - flat.mean()
    assert a.transitions == 5
    by_hand = float((t * f).sum() / math.sqrt((t * t).sum() * (f * f).sum()))
    assert agreement(flat, truth, se, steps).pearson == pytest.approx(by_hand)
    # |truth| > 2 SE on the first four only; flat's signs match 2 of them (0.3 and -0.4)
    assert agreement(flat, truth, se, steps).sign == pytest.approx(0.5)
    assert spearman(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0, 20.0, 15.0])) == pytest.approx(0.5)
    assert math.isnan(pearson(torch.tensor([1.0, 1.0]), torch.tensor([1.0, 2.0])))  # a constant: undefined


def test_continuations_advance_together_and_count_their_evaluations():
    starts = torch.zeros(3, *SHAPE)
    noise = torch.ones(1, 2, T, *SHAPE)
    programs = [[(0, 1, True, 0.7), (1, 2, True, 0.7)], [(3, 4, True, 0.7)], []]
    ends, evaluations = run_continuations(channel_stepper, starts, torch.zeros(3, dtype=torch.long),
                                          torch.tensor([0, 1, 0]), programs, torch.linspace(1, 0, T + 1), noise)
    assert evaluations == 3
    assert ends[0, :, 0, 0].tolist() == [1, 1, 0, 0] and ends[1, :, 0, 0].tolist() == [0, 0, 0, 1]
    assert ends[2].abs().sum() == 0


@pytest.mark.heavy
def test_flat_flow_grpo_gives_every_step_of_a_trajectory_one_advantage_and_credit_runs(tmp_path, capsys):
    out = tmp_path / "credit"
    code = main(["credit", str(ROOT / "configs/tiny_default.yaml"), "--labels", "flow_grpo", "branch_grpo",
                 "--prompts", "1", "--continuations", "2", "--steps", "3", "--out", str(out), "--quiet"])
    assert code == 0
    import json

    data = json.loads((out / "credit.json").read_text())
    flat = next(r for r in data["labels"] if r["label"] == "flow_grpo")
    # flat Flow-GRPO: trajectory k's advantage at every trained step is the same (its reward's z-score)
    per_step = [flat["assigned_by_step"][str(s)] for s in sorted(map(int, flat["assigned_by_step"]))]
    assert len(per_step) >= 2 and all(p == per_step[0] for p in per_step)
    assert flat["trained"] == 8 * len(per_step)
    assert (out / "credit_per_step.png").stat().st_size > 0 and "| flow_grpo |" in (out / "credit.md").read_text()
