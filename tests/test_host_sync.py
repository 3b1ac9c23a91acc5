"""The rollout makes a fixed number of host synchronisations whatever the number of denoising rounds: counted on
the CPU by :class:`tests.host_sync.HostSyncCounter` (the operations that make a CUDA host wait, here on CPU
tensors), with hand-made cases showing what the counter sees."""

from __future__ import annotations

import pytest
import torch

from tests.host_sync import HostSyncCounter


def test_the_counter_sees_each_kind_of_synchronising_operation_and_nothing_else():
    t = torch.arange(6.0)
    with HostSyncCounter("cpu") as c:
        y = (t * 2 + 1).exp().sum(0)  # queued work: nothing to wait for
        _ = t[torch.tensor([0, 2])]  # indexing with positions: the output size is known
        _ = t.repeat_interleave(2)
    assert c.total == 0 and y.ndim == 0
    with HostSyncCounter("cpu") as c:
        float(t[1]), t.sum().item()  # two values read
        torch.nonzero(t > 2)  # a data-dependent size
        t[t > 2]  # boolean-mask indexing
        t.tolist()
        t.repeat_interleave(torch.tensor([1, 2, 1, 1, 1, 1]))
    assert c.counts["aten::_local_scalar_dense"] == 2 and c.counts["aten::nonzero"] == 1
    assert c.counts["aten::index.Tensor (boolean mask)"] == 1 and c.counts["tolist"] == 1
    assert c.counts["aten::repeat_interleave.Tensor"] == 1 and c.total == 6
    with HostSyncCounter("cuda:0") as c:  # another device's tensors are not counted
        t.sum().item()
    assert c.total == 0


def _tiny_rollout(steps: int):
    from flowrl.config import load_config
    from flowrl.engine import rollout
    from flowrl.models import load_adapter
    from flowrl.samplers.plans import RolloutPlan, StepSpec
    from flowrl.sampling import sigmas_for

    cfg = load_config(None, ["device=cpu", "log.progress=false"])
    adapter = load_adapter(cfg.model, "cpu")
    cond = adapter.encode_prompts(["a red circle on a blue background", "a green square on a white background"])
    shape = adapter.latent_shape(cfg.model.resolution)
    plan = RolloutPlan([StepSpec(sde=True, branch=4 if i == 0 else 1, trained=True, side=2 if i == 1 else 0)
                        for i in range(steps)])
    sigmas = sigmas_for(cfg, adapter, steps)
    return lambda: rollout(adapter, cond, plan, sigmas, shape, kernel="flow_grpo", noise_level=0.7,
                           generator=torch.Generator().manual_seed(0), max_batch=5)


@pytest.mark.parametrize("kind", ["branches and side jumps"])
def test_the_rollout_synchronises_as_often_for_8_rounds_as_for_4(kind):
    """Branching, side jumps and their ODE completions, several transformer calls per round (max_batch 5 < 8
    nodes): the operations that would make a CUDA host wait are as many for 8 rounds as for 4 (the tree's shape
    comes from the plan, the index lists go to the device once, the log-probs come back once)."""
    short, long = _tiny_rollout(4), _tiny_rollout(8)
    short()  # caches (prompt embeddings) filled outside the count
    with HostSyncCounter("cpu") as four:
        tree4 = short()
    with HostSyncCounter("cpu") as eight:
        tree8 = long()
    assert tree4.num_rounds == 4 and tree8.num_rounds == 8 and tree8.nfe > tree4.nfe
    assert four.counts == eight.counts, (dict(four.counts), dict(eight.counts))
    assert four.total <= 2, dict(four.counts)
