"""Rollout in prompt batches with scoring overlapped: the same tree as one rollout, the same rewards as synchronous
scoring, and metrics that say how much scoring time the overlap hid."""

import math
import threading

import torch
from flowrl.samplers import RolloutPlan, StepSpec

from flowrl.engine import Tree, rollout
from tests.conftest import make_cfg
from tests.helpers import tree_skeleton


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
    a = tree_skeleton([[0, 0], [0, 0, 1, 1]])  # one prompt, one root, branching 2 x 2
    b = tree_skeleton([[0, 1], [0, 1, 1]], groups=[0, 1])  # two prompts with a root each
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


def test_packed_rollouts_equal_unpacked_with_fewer_calls(tiny_adapter, tiny_cfg):
    """Three prompt batches of a BranchGRPO-shaped tree (branch 2 at steps 0 and 2 of 6), each with its own
    generator, staggered through shared calls: every tree's latents, log-probs and stds equal its own rollout's,
    and the calls drop from 3 x 6 to 6 + 2 x 2 (the batches start 2 rounds apart)."""
    from flowrl.engine import packed_rollouts
    from flowrl.sampling import sigmas_for

    ad = tiny_adapter
    sig = sigmas_for(tiny_cfg, ad, 6)
    shape = ad.latent_shape(16)
    prompts = ["a red circle on a blue background", "a green square on a white background", "a blue cross",
               "a white triangle on a red background", "a red square"]
    cond = ad.encode_prompts(prompts)
    plan = RolloutPlan([StepSpec(branch=2 if i in (0, 2) else 1, trained=True, sibling_noise="correlated")
                        for i in range(6)])
    batches = [(0, 2, 11), (2, 4, 12), (4, 5, 13)]
    kw = dict(kernel="flow_grpo", noise_level=0.7)
    alone = [rollout(ad, cond.index(torch.arange(a, b)), plan, sig, shape, generator=torch.Generator().manual_seed(s),
                     **kw) for a, b, s in batches]
    finished = []
    packed = packed_rollouts(ad, cond, [(a, b, torch.Generator().manual_seed(s)) for a, b, s in batches], plan, sig,
                             shape, stagger=2, on_done=lambda j, t: finished.append(j), **kw)
    assert finished == [0, 1, 2]
    for t_alone, t_packed in zip(alone, packed):
        assert t_packed.nfe == t_alone.nfe
        for name in ("latents", "log_prob", "std", "index", "group", "parent"):
            for x, y in zip(getattr(t_alone, name), getattr(t_packed, name)):
                assert torch.allclose(x.float(), y.float(), atol=1e-5), name
        assert float(t_alone.log_prob[1].abs().sum()) > 0
    assert sum(t.transformer_calls for t in alone) == 18
    assert sum(t.transformer_calls for t in packed) == 10


def test_trainer_packed_rollouts_give_the_same_iteration(tmp_path):
    from flowrl.trainer import Trainer

    rows = {}
    for packed in (False, True):
        cfg = make_cfg(tmp_path / str(packed), "train.iterations=1", "train.prompts_per_iter=2", "algorithm.group_size=3",
                       "sampler.num_steps=4", "sampler.rollout_batches=2", f"sampler.pack_rollouts={packed}")
        rows[packed] = Trainer(cfg).iteration(0)
    assert rows[True]["reward_mean/total"] == rows[False]["reward_mean/total"]
    assert rows[True]["ratio_mean"] == rows[False]["ratio_mean"]
    assert rows[True]["transformer_calls_rollout"] < rows[False]["transformer_calls_rollout"] == 8


def _reward_threads() -> list:
    import threading

    return [t for t in threading.enumerate() if t.name.startswith("flowrl-reward")]


def test_the_reward_worker_ends_with_training_and_on_error(tmp_path):
    """With async scoring a worker thread scores batch k while batch k + 1 rolls out; it is closed when training
    ends, and when an iteration fails."""
    import pytest

    from flowrl.trainer import Trainer
    from tests.helpers import FailsOnSecondCall

    before = _reward_threads()  # workers of other tests' trainers that were never trained to the end
    cfg = make_cfg(tmp_path / "ok", "train.iterations=1", "sampler.rollout_batches=2", "train.prompts_per_iter=2")
    trainer = Trainer(cfg)
    seen = []
    score = trainer.runner.rewards
    # each batch is scored on the reward worker's thread while the next one rolls out
    trainer.runner.rewards = lambda *a: (seen.append(threading.current_thread().name.startswith("flowrl-reward")),
                                         score(*a))[1]
    trainer.train()
    assert seen == [True, True]  # both batches were scored while the worker was up
    assert set(_reward_threads()) <= set(before)
    FailsOnSecondCall.calls = 0
    cfg = make_cfg(tmp_path / "fails", "train.iterations=2", "sampler.rollout_batches=2", "train.prompts_per_iter=2",
                   "rewards=[{name: 'tests.helpers:FailsOnSecondCall'}]")
    trainer = Trainer(cfg)
    with pytest.raises(Exception, match="the reward went away"):
        trainer.train()
    assert set(_reward_threads()) <= set(before)
