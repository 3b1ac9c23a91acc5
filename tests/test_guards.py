"""Guards against collapse and over-optimisation: the best held-out checkpoint, early stopping, KL to a
reference for full fine-tuning, GRPO-Guard's ratio normalisation."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flowrl.cli import main
from flowrl.config import load_config
from flowrl.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def run_dir(out: Path) -> Path:
    (d,) = [p for p in out.iterdir() if p.is_dir()]
    return d


@pytest.mark.heavy
def test_a_collapsing_run_stops_early_and_ends_with_its_best_weights(tmp_path, capsys):
    """The main job at 30x its learning rate: the held-out curve falls by more than the allowed drop at its
    second point, the run stops there, and the weights it ends with (evaluated as 'after', exported in
    checkpoints/best) are the best point's: the pretrained ones, evaluated exactly as 'before'."""
    code = main(["train", str(ROOT / "configs" / "tiny_default.yaml"), "train.iterations=12", "train.lr=6e-3",
                 "log.eval_every=2", "log.eval_curve_seeds=2", "log.eval_seeds=[0, 1]", "log.early_stop_drop=0.15",
                 f"log.output_dir={tmp_path}", "log.progress=false", "log.sample_every=0", "log.save_every=0"])
    assert code == 0
    out = capsys.readouterr()
    summary = json.loads(out.out.strip().splitlines()[-1])
    run = run_dir(tmp_path)
    curve = [json.loads(line) for line in (run / "eval_curve.jsonl").read_text().splitlines()]
    assert [c["iteration"] for c in curve] == [0, 2] and curve[0]["all"] - curve[1]["all"] > 0.15
    assert summary["iterations"] == 2 and summary["best"]["iteration"] == 0
    assert summary["best"]["stopped_early"].startswith("stopping early at iteration 2: held-out all")
    assert "the run ends with its best held-out weights" in out.err
    assert summary["heldout_after"] == summary["heldout_before"]  # the best weights, evaluated again
    exported = load_file(str(run / "checkpoints" / "best" / "transformer" / "diffusion_pytorch_model.safetensors"))
    from flowrl.models import load_adapter

    pretrained = load_adapter(load_config(ROOT / "configs" / "tiny_default.yaml", []).model).transformer.state_dict()
    assert all(torch.equal(exported[k], pretrained[k]) for k in exported)


def test_the_best_point_mid_run_is_the_one_kept(tmp_path, capsys):
    """A scripted curve 0.5, 0.6, 0.8, 0.7, 0.4: the best is after iteration 2; patience 2 stops at 4; the
    exported weights are those the policy had after iteration 2 (its own checkpoint), not the last ones."""
    code = main(["train", "log.eval=tests.helpers:ScriptedCurve", "log.eval_every=1", "log.early_stop_patience=2",
                 "train.iterations=8", "train.lora.enabled=false", "train.lr=1e-2", "sampler.num_steps=3",
                 "train.prompts_per_iter=1", "algorithm.group_size=2", "log.save_every=1", "log.keep_checkpoints=10",
                 "log.sample_every=0", f"log.output_dir={tmp_path}", "log.progress=false"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["best"]["iteration"] == 2 and summary["best"]["value"] == 0.8
    assert summary["iterations"] == 4 and "no new best held-out all in 2 curve points" in summary["best"]["stopped_early"]
    run = run_dir(tmp_path)
    name = "transformer/diffusion_pytorch_model.safetensors"
    best = load_file(str(run / "checkpoints" / "best" / name))
    at_2 = load_file(str(run / "checkpoints" / "iter_00001" / name))  # saved after iteration index 1 = 2 done
    last = load_file(str(run / "checkpoints" / "iter_00003" / name))
    assert all(torch.equal(best[k], at_2[k]) for k in best)
    assert any(not torch.equal(best[k], last[k]) for k in best)
    # the run ended with the best weights, so the run directory means them (sample / eval / export --checkpoint)
    from flowrl.checkpoint import find_checkpoint

    assert find_checkpoint(run) == run / "checkpoints" / "best"
    assert find_checkpoint(run, iteration=3) == run / "checkpoints" / "iter_00003"


def test_a_last_point_that_ties_the_best_keeps_the_trained_weights(tmp_path, capsys):
    """Curve 0.5, 0.8, 0.6, 0.8: the earlier 0.8 does not beat the last one, so the run ends with the weights it
    trained (no restore, `--checkpoint RUN` means the last iteration's checkpoint)."""
    code = main(["train", "log.eval=tests.helpers:TiedCurve", "log.eval_every=1", "train.iterations=3",
                 "train.lora.enabled=false", "train.lr=1e-2", "sampler.num_steps=3", "train.prompts_per_iter=1",
                 "algorithm.group_size=2", "log.save_every=1", "log.sample_every=0", f"log.output_dir={tmp_path}",
                 "log.progress=false"])
    assert code == 0
    out = capsys.readouterr()
    summary = json.loads(out.out.strip().splitlines()[-1])
    assert summary["best"]["iteration"] == 1 and summary["best"]["value"] == 0.8
    assert "the run ends with its best held-out weights" not in out.err
    run = run_dir(tmp_path)
    assert not json.loads((run / "best.json").read_text()).get("ended_with")
    from flowrl.checkpoint import find_checkpoint

    assert find_checkpoint(run) == run / "checkpoints" / "iter_00002"


def test_early_stopping_needs_the_held_out_curve():
    with pytest.raises(ConfigError, match="set log.eval .* and log.eval_every"):
        load_config(None, ["log.early_stop_patience=3"])


@pytest.mark.parametrize("reference", ["initial", "ema"])
def test_kl_to_a_reference_under_full_fine_tuning(tmp_path, reference):
    """Full fine-tuning with train.kl_beta: the reference is a frozen copy of the starting weights (or the EMA).
    The first update's KL is exactly 0 (policy == reference); after an update it is positive, and the reference
    velocity is the starting model's (initial) or the EMA weights' (ema), not the trained one's."""
    from flowrl.models import load_adapter
    from flowrl.trainer import Trainer

    cfg = load_config(None, ["train.lora.enabled=false", "train.kl_beta=0.5", f"train.kl_reference={reference}",
                             "train.ema.enabled=true", "train.ema.decay=0.5", "train.lr=1e-2", "sampler.num_steps=3",
                             "train.prompts_per_iter=1", "algorithm.group_size=2", f"log.output_dir={tmp_path}",
                             "log.run_name=k", "log.sample_every=0", "log.save_every=0", "log.progress=false"])
    trainer = Trainer(cfg)
    first = trainer.iteration(0)
    assert first["kl_loss"] == 0.0 and first["ratio_max_abs_dev_first_update"] < 1e-6
    second = trainer.iteration(1)
    assert second["kl_loss"] > 0
    adapter, policy = trainer.adapter, trainer.policy
    x = torch.randn((2, *trainer.latent_shape), generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.9, 0.5])
    cond = adapter.encode_prompts(["a", "b"])
    with torch.no_grad():
        trained = adapter.velocity(x, sigma, cond)
        with policy.reference():
            ref = adapter.velocity(x, sigma, cond)
        if reference == "initial":
            expect = load_adapter(cfg.model).velocity(x, sigma, cond)
        else:
            with policy.ema_weights():
                expect = adapter.velocity(x, sigma, cond)
        after = adapter.velocity(x, sigma, cond)
    assert torch.equal(ref, expect) and torch.equal(after, trained)  # the context gives the policy back
    assert (ref - trained).abs().max() > 1e-4


def test_an_ema_reference_needs_the_ema():
    with pytest.raises(ConfigError, match="train.kl_reference=ema: .* set train.ema.enabled=true"):
        load_config(None, ["train.kl_beta=0.1", "train.kl_reference=ema"])


def test_grpo_guard_log_ratio_is_the_centred_form_by_hand():
    """x' = mu_old + s eps with per-element-mean Gaussian log-probs: (logp - logp_old + bias) * s equals
    mean((mu - mu_old) * eps), while the plain log-ratio is that / s minus the bias. By hand for one 2-element
    edge: mu_old = (0, 0), mu = (0.1, -0.2), eps = (1, 2), s = 0.5 -> mean(0.1 * 1, -0.2 * 2) = -0.15."""
    from flowrl.losses import guard_log_ratio
    from flowrl.samplers.kernels import gaussian_log_prob

    mu_old, mu = torch.zeros(1, 2), torch.tensor([[0.1, -0.2]])
    eps, s = torch.tensor([[1.0, 2.0]]), torch.full((1, 2), 0.5)
    x = mu_old + s * eps
    logp, old = gaussian_log_prob(x, mu, s), gaussian_log_prob(x, mu_old, s)
    bias = (0.1**2 + 0.2**2) / 2 / (2 * 0.25)  # 0.05
    assert float(logp - old) == pytest.approx(-0.15 / 0.5 - bias, abs=1e-6)
    assert float(guard_log_ratio(logp, old, mu, mu_old, s)) == pytest.approx(-0.15, abs=1e-6)
    # random edges: the identity holds per edge
    g = torch.Generator().manual_seed(0)
    mu_old, delta, eps = (torch.randn(5, 3, 4, 4, generator=g) for _ in range(3))
    s = torch.rand(5, 1, 1, 1, generator=g) + 0.1
    mu = mu_old + 0.1 * delta
    x = mu_old + s * eps
    got = guard_log_ratio(gaussian_log_prob(x, mu, s), gaussian_log_prob(x, mu_old, s), mu, mu_old, s)
    assert torch.allclose(got, ((mu - mu_old) * eps).mean(dim=(1, 2, 3)), atol=1e-5)


def test_grpo_guard_trains_with_ratio_one_first_and_needs_flow_sde(tmp_path):
    from flowrl.trainer import Trainer

    cfg = load_config(None, ["train.grpo_guard=true", "sampler.num_steps=4", "train.prompts_per_iter=2",
                             "algorithm.group_size=2", "train.num_minibatches=2", f"log.output_dir={tmp_path}",
                             "log.run_name=g", "log.sample_every=0", "log.save_every=0", "log.progress=false"])
    trainer = Trainer(cfg)
    row = trainer.iteration(0)
    assert row["ratio_max_abs_dev_first_update"] == 0.0 and row["optimizer_steps"] == 2
    assert row["ratio_mean"] != 1.0  # the second minibatch sees the moved policy through the normalised ratio
    # the stored means are the sampling means: each SDE node's old log-prob is its latent's under N(mean, std)
    from flowrl.engine import rollout
    from flowrl.samplers.kernels import gaussian_log_prob
    from flowrl.samplers.plans import RolloutPlan, StepSpec

    plan = RolloutPlan([StepSpec(sde=k % 2 == 0, trained=k % 2 == 0) for k in range(4)], roots_per_prompt=2)
    tree = rollout(trainer.adapter, trainer.adapter.encode_prompts(["a"]), plan, trainer.sigmas,
                   trainer.latent_shape, kernel="flow_grpo", noise_level=0.7, generator=torch.Generator().manual_seed(0),
                   store_mean=True)
    assert len(tree.mean) == len(tree.latents) == 5
    for r in (1, 3):  # SDE steps 0 and 2
        std = tree.std[r].view(-1, 1, 1, 1)
        assert torch.allclose(gaussian_log_prob(tree.latents[r], tree.mean[r], std), tree.log_prob[r], atol=1e-5)
    for r in (2, 4):  # ODE steps: the mean is the sample
        assert torch.equal(tree.mean[r], tree.latents[r])
    with pytest.raises(ConfigError, match="set sampler.kernel=flow_grpo"):
        load_config(None, ["train.grpo_guard=true", "sampler.kernel=dance"])


def test_kl_at_the_untrained_steps_by_hand(tmp_path):
    """train.kl_untrained_beta: with a window of one trained step, the states drawn are those of the ODE steps
    after it (3 of 4 steps x 2 leaves = 6 here), and each one's KL equals the Flow-SDE closed form
    mean((dv)^2) * (1 + sig^2 (1 - t) / (2t))^2 |dt| / (2 sig^2), sig = a sqrt(t / (1 - t)), with dv the trained
    minus the reference velocity. 0 on the first update (policy == reference), positive after it."""
    from flowrl.trainer import Trainer

    from flowrl.objectives import untrained_states

    a = 0.7
    cfg = load_config(None, ["train.lora.enabled=false", "train.kl_untrained_beta=1.0", "train.kl_untrained_states=4",
                             "algorithm.name=flow_grpo_fast", "algorithm.window.size=1", "algorithm.window.start=0",
                             f"sampler.noise_level={a}", "sampler.kernel=flow_grpo", "sampler.guidance_scale=1.0",
                             "train.lr=1e-2", "sampler.num_steps=4", "train.prompts_per_iter=1",
                             "algorithm.group_size=2", f"log.output_dir={tmp_path}", "log.run_name=u",
                             "log.sample_every=0", "log.save_every=0", "log.progress=false"])
    trainer = Trainer(cfg)
    seen = []
    objective = trainer.objective
    plain = objective._untrained_kl  # the KL of given states, in the iteration being trained

    def record(rounds, child):
        out = plain(rounds, child)
        seen.append((objective.batch.tree, objective.batch.cond, rounds, child, out.detach()))
        return out

    objective._untrained_kl = record
    first = trainer.iteration(0)
    assert first["kl_untrained"] == 0.0 and first["nfe_train"] == 2 + 4  # 2 trained edges + 4 drawn states
    tree = seen[0][0]
    rounds, child = untrained_states(tree)
    assert rounds.tolist() == [2, 2, 3, 3, 4, 4] and not tree.trained[2].any() and tree.trained[1].all()
    second = trainer.iteration(1)
    assert second["kl_untrained"] > 0
    tree, cond, rounds, child, kl = seen[1]
    assert len(kl) == 4 and set(rounds.tolist()) <= {2, 3, 4}
    parent = torch.stack([tree.parent[r][c] for r, c in zip(rounds.tolist(), child.tolist())])
    x = torch.stack([tree.latents[r - 1][p] for r, p in zip(rounds.tolist(), parent.tolist())])
    t = torch.stack([tree.sigmas[tree.index[r - 1][p]] for r, p in zip(rounds.tolist(), parent.tolist())])
    t_next = torch.stack([tree.sigmas[tree.index[r][c]] for r, c in zip(rounds.tolist(), child.tolist())])
    rows = torch.stack([tree.group[r - 1][p] for r, p in zip(rounds.tolist(), parent.tolist())])
    with torch.no_grad():
        v = trainer.adapter.velocity(x, t, cond.index(rows))
        with trainer.policy.reference():
            v_ref = trainer.adapter.velocity(x, t, cond.index(rows))
        now = plain(rounds, child)  # iteration 1's states, with the weights as they are now (one more step was taken)
    dv2 = ((v - v_ref) ** 2).flatten(1).mean(1)
    sig2 = a**2 * t / (1 - t)
    expect = dv2 * (1 + sig2 * (1 - t) / (2 * t)) ** 2 * (t - t_next) / (2 * sig2)
    assert (expect > 1e-8).all()
    torch.testing.assert_close(now, expect, rtol=1e-4, atol=0)


def test_kl_at_untrained_steps_is_refused_where_it_cannot_apply():
    with pytest.raises(ConfigError, match="train.kl_untrained_beta: .* sampler.noise_level, which is 0"):
        load_config(None, ["train.kl_untrained_beta=0.2", "sampler.noise_level=0"])
    with pytest.raises(ConfigError, match="train.kl_untrained_beta: diffusion_nft trains on the forward process"):
        load_config(None, ["train.kl_untrained_beta=0.2", "algorithm.name=diffusion_nft"])
