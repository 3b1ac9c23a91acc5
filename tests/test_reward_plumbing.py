"""Rollout in prompt batches with scoring overlapped: the same tree as one rollout, the same rewards as synchronous
scoring, and metrics that say how much scoring time the overlap hid."""

import math

import torch
from flowrl.samplers import RolloutPlan, StepSpec

from flowrl.engine import Tree, rollout
from tests.conftest import make_cfg


def test_concat_of_batched_rollouts_equals_one_rollout(tiny_adapter, tiny_cfg):
    from flowrl.sampling import sigmas_for

    ad = tiny_adapter
    sig = sigmas_for(tiny_cfg, ad, 4)
    shape = ad.latent_shape(16)
    prompts = ["a red circle on a blue background", "a green square on a white background", "a blue cross"]
    plan = RolloutPlan([StepSpec(sde=False) for _ in range(4)], roots_per_prompt=2)
    noise = torch.randn(6, *shape, generator=torch.Generator().manual_seed(0))
    cond = ad.encode_prompts(prompts)
    kw = dict(kernel="ode", noise_level=0.0, generator=torch.Generator())
    whole = rollout(ad, cond, plan, sig, shape, initial_noise=noise, **kw)
    parts = [rollout(ad, cond.index(torch.tensor(rows)), plan, sig, shape, initial_noise=noise[2 * rows[0]:2 * rows[-1] + 2], **kw)
             for rows in ([0], [1, 2])]
    joined = Tree.concat(parts)
    assert joined.num_rounds == whole.num_rounds and joined.nfe == whole.nfe
    # same nodes, grouped batch by batch: compare after sorting each round by (root, position within root)
    for r in range(whole.num_rounds + 1):
        assert torch.equal(torch.sort(joined.root[r]).values, torch.sort(whole.root[r]).values)
    assert torch.equal(joined.leaf_group, whole.leaf_group)  # prompt-major in both
    assert torch.allclose(joined.leaves, whole.leaves, atol=1e-5)
    # parents point at the right node: a child's root is its parent's root
    for r in range(1, joined.num_rounds + 1):
        assert torch.equal(joined.root[r], joined.root[r - 1][joined.parent[r]])


def test_async_scoring_matches_sync_and_reports_hidden_time(tmp_path):
    from flowrl.trainer import Trainer

    rows = {}
    for name, extra in (("sync1", ["sampler.rollout_batches=1"]),
                        ("sync2", ["sampler.rollout_batches=2", "sampler.async_reward=false"]),
                        ("async2", ["sampler.rollout_batches=2"])):
        cfg = make_cfg(tmp_path / name, "train.iterations=1", "train.prompts_per_iter=2", "algorithm.group_size=2",
                       "sampler.num_steps=4", "rewards=[{name: 'tests.helpers:slow_brightness'}]", *extra)
        rows[name] = Trainer(cfg).iteration(0)
    assert rows["sync1"]["leaves"] == rows["async2"]["leaves"] == 4
    assert rows["sync2"]["reward_mean/slow_brightness"] == rows["async2"]["reward_mean/slow_brightness"]
    assert rows["async2"]["rollout_batches"] == 2 and rows["sync2"]["seconds_reward_hidden"] == 0.0
    a = rows["async2"]
    assert 0.0 < a["seconds_reward_hidden"] <= a["seconds_reward"]
    assert abs(a["seconds_reward"] - a["seconds_reward_wait"] - a["seconds_reward_hidden"]) < 1e-9


def test_concat_shifts_parents_groups_and_roots_by_hand():
    a = Tree.skeleton([[0, 0], [0, 0, 1, 1]])  # one prompt, one root, branching 2 x 2
    b = Tree.skeleton([[0, 1], [0, 1, 1]], groups=[0, 1])  # two prompts with a root each
    t = Tree.concat([a, b])
    assert t.parent[1].tolist() == [0, 0, 1, 2]
    assert t.parent[2].tolist() == [0, 0, 1, 1, 2, 3, 3]
    assert t.group[2].tolist() == [0, 0, 0, 0, 1, 2, 2]
    assert t.root[2].tolist() == [0, 0, 0, 0, 1, 2, 2]
    assert t.node_values_from_leaves(torch.arange(7.0))[0].tolist() == [1.5, 4.0, 5.5]


def test_multi_reward_config_trains_with_per_reward_advantages(tmp_path):
    from pathlib import Path

    from flowrl.config import load_config
    from flowrl.trainer import Trainer

    path = Path(__file__).resolve().parent.parent / "configs" / "tiny_multi_reward.yaml"
    cfg = load_config(path, [f"log.output_dir={tmp_path}", "log.run_name=m", "log.progress=false",
                             "train.prompts_per_iter=2", "algorithm.group_size=3", "sampler.num_steps=4",
                             "algorithm.window.size=2"])
    row = Trainer(cfg).iteration(0)
    assert {"reward_mean/shapes", "reward_mean/clip", "reward_mean/total"} <= set(row)
    assert 0.0 < row["reward_mean/clip"] < 1.0 and 0.0 < row["reward_mean/shapes"] <= 1.0
    assert row["rollout_batches"] == 2 and row["trained_edges"] > 0


def test_nan_rewards_are_masked_counted_and_training_continues(tmp_path):
    from flowrl.trainer import Trainer

    cfg = make_cfg(tmp_path, "train.iterations=2", "train.prompts_per_iter=2", "algorithm.group_size=4",
                   "sampler.num_steps=4", "rewards=[{name: 'tests.helpers:half_nan'}, {name: 'tests.helpers:brightness'}]")
    trainer = Trainer(cfg)
    rows = [trainer.iteration(it) for it in range(2)]
    for row in rows:
        assert row["reward_nan_count"] == 4  # every other leaf of 8
        assert math.isfinite(row["reward_mean/total"]) and math.isfinite(row["policy_loss"])
        assert row["trained_edges"] > 0
