"""Every preset loads, starts with the command that runs it, and its plan has the documented shape."""

from pathlib import Path

import pytest
from flowrl.samplers import make_sigmas

from flowrl.algorithms import make_algorithm
from flowrl.algorithms.side_branch import SideBranchAlgorithm
from flowrl.config import load_config

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted(ROOT.glob("configs/*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_preset_loads_and_names_its_command(path):
    first = path.read_text().splitlines()[0]
    assert first.startswith("# flowrl train configs/" + path.name), first
    cfg = load_config(path)
    t = cfg.sampler.num_steps
    sigmas = make_sigmas(cfg.sampler.schedule, t, shift=cfg.sampler.shift, mu=0.0,
                         scheduler_config={"shift": 3.0, "num_train_timesteps": 1000})
    algo = make_algorithm(cfg)
    plan = algo.plan(0, sigmas=sigmas)
    if isinstance(algo, SideBranchAlgorithm):  # side-branch trees: group_size branches per active step and seed
        active = len(algo.active_steps())
        assert plan.leaves_per_prompt == cfg.algorithm.group_size * cfg.algorithm.seeds * active
    else:  # SuperFlow's plan holds its largest group (each prompt's own size comes from the tracker)
        a = cfg.algorithm
        assert plan.leaves_per_prompt == (getattr(a, "group_size", None) or getattr(a, "samples_per_prompt", None)
                                          or a.max_group)
    # every preset trains something: edges, or (DiffusionNFT, ReFL, ...) re-noised or re-run samples of an all-ODE
    # rollout
    on_edges = algo.make_objective(None).trains_transitions
    assert plan.counts()["trained_edges"] > 0 if on_edges else plan.counts()["trained_edges"] == 0


def test_preset_accounting():
    fg = make_algorithm(load_config(ROOT / "configs/tiny_flow_grpo.yaml")).plan(0)
    assert fg.accounting() == {"leaves_per_prompt": 8, "nfe_rollout_per_leaf": 10.0, "edges_per_leaf": 10.0,
                               "trained_edges_per_leaf": 9.0}
    dance = make_algorithm(load_config(ROOT / "configs/tiny_dance_grpo.yaml")).plan(0)
    assert dance.accounting()["nfe_rollout_per_leaf"] == (1 + 8 * 9) / 8
    mix = make_algorithm(load_config(ROOT / "configs/tiny_mix_grpo.yaml")).plan(0)
    assert mix.accounting()["trained_edges_per_leaf"] == 3.0
    assert mix.accounting()["nfe_rollout_per_leaf"] == 1 / 8 + 9  # root once, then 8 nodes x 9 depths


def test_shapes_branch_preset_accounting():
    # splits at steps 0 and 1 with K = 2 over 10 steps: per tree 1 + 2 parents, then 4 chains of 8 steps
    # -> 35 transformer passes and 2 + 4 + 4 * 8 = 38 edges for 4 leaves; Mix trains the 6 edges of steps 0-1
    plan = make_algorithm(load_config(ROOT / "configs/tiny_shapes_branch_grpo.yaml")).plan(0)
    assert plan.accounting() == {"leaves_per_prompt": 4, "nfe_rollout_per_leaf": 35 / 4, "edges_per_leaf": 38 / 4,
                                 "trained_edges_per_leaf": 6 / 4}
