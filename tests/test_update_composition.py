"""train.update_composition=rollout: the update recomputes every trained parent state inside the very transformer
call of the rollout that evaluated it (the engine records each node's call and row), so the first update's ratio
is 1 even where kernels depend on the batch; the default batches the update by train.micro_batch."""

from __future__ import annotations

import json

import pytest
import torch

from flowrl.config import load_config
from flowrl.errors import ConfigError

COMMON = ["train.iterations=1", "train.prompts_per_iter=2", "log.sample_every=0", "log.save_every=0",
          "log.progress=false", "log.eval=none", "train.kl_beta=0", "train.kl_untrained_beta=0",
          "train.num_minibatches=1", "train.inner_epochs=1", "sampler.max_batch=3", "train.micro_batch=2"]


def _run(tmp_path, composition: str, precision: str = "no", batch_dependent: bool = False):
    from flowrl.trainer import Trainer

    cfg = load_config("configs/tiny_flow_grpo.yaml", [*COMMON, f"log.output_dir={tmp_path}",
                                                      f"log.run_name={composition}-{precision}",
                                                      f"train.update_composition={composition}",
                                                      f"train.mixed_precision={precision}"])
    trainer = Trainer(cfg)
    calls = {"rollout": [], "update": []}

    def hook(module, args, kwargs):
        phase = trainer.meter.current
        if phase in calls:
            calls[phase].append((kwargs["hidden_states"].detach().clone(), kwargs["timestep"].detach().clone()))

    trainer.policy.module.register_forward_pre_hook(hook, with_kwargs=True)
    if batch_dependent:  # each row's output moved by 1e-3 x the mean of its call's outputs
        trainer.policy.module.register_forward_hook(lambda m, a, out: (out[0] + 1e-3 * out[0].mean(0, keepdim=True),
                                                                       *out[1:]))
    run = trainer.train()
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    return calls, row


def test_each_update_forward_is_one_rollout_call_with_its_rows_in_their_order(tmp_path):
    calls, row = _run(tmp_path, "rollout")
    rollout = calls["rollout"]
    assert len(calls["update"]) >= 2 and max(x.shape[0] for x, _ in rollout) == 3  # sampler.max_batch
    for x, t in calls["update"]:  # the same latents and sigmas, row for row: one of the rollout's calls
        assert sum(torch.equal(x, rx) and torch.equal(t, rt) for rx, rt in rollout) >= 1
    # every call that evaluated a trained parent state runs once: the forwarded rows are those calls' rows
    assert row["nfe_train"] == sum(x.shape[0] for x, _ in calls["update"])
    assert row["ratio_max_abs_dev_first_update"] == 0.0


def test_the_default_batches_the_update_by_micro_batch(tmp_path):
    calls, row = _run(tmp_path, "micro_batch")
    assert max(x.shape[0] for x, _ in calls["update"]) <= 2  # train.micro_batch
    assert row["nfe_train"] == sum(x.shape[0] for x, _ in calls["update"])


@pytest.mark.parametrize("composition, exact", [("micro_batch", False), ("rollout", True)])
def test_a_batch_dependent_model_keeps_ratio_1_only_in_the_rollout_s_calls(tmp_path, composition, exact):
    """A GPU's bf16 kernels may round a row differently in another batch; here the transformer's output gets a
    small term that depends on the whole batch, so that a row's velocity depends on its call's other rows. Only
    the update that recomputes the rollout's own calls sees the rollout's log-probs exactly."""
    _, row = _run(tmp_path, composition, batch_dependent=True)
    deviation = row["ratio_max_abs_dev_first_update"]
    assert (deviation == 0.0) if exact else (deviation > 1e-6), deviation


@pytest.mark.parametrize("override, key", [("train.fsdp.enabled=true", "train.fsdp.enabled"),
                                           ("train.cfg=false", "train.cfg")])
def test_settings_that_change_the_calls_are_refused_in_one_line(override, key):
    extra = ["sampler.guidance_scale=4.5"] if key == "train.cfg" else []
    with pytest.raises(ConfigError) as err:
        load_config("configs/tiny_flow_grpo.yaml", ["train.update_composition=rollout", override, *extra])
    assert key in str(err.value) and "\n" not in str(err.value)
