"""On-policy distillation: the teacher becomes the KL reference, the loss is the KL alone, and the student
approaches the teacher."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_cfg

BASE = ["sampler.num_steps=4", "train.prompts_per_iter=2", "rewards[0].name=jpeg_incompressibility",
        "algorithm.group_size=2"]


def test_student_approaches_its_teacher(tmp_path):
    from flowrl.trainer import Trainer

    teacher = Trainer(make_cfg(tmp_path / "teacher", *BASE, "train.iterations=2", "train.lr=1e-2")).train()
    cfg = make_cfg(tmp_path / "student", *BASE, "algorithm.name=on_policy_distillation",
                   f"algorithm.teacher={teacher}", "train.kl_beta=1.0", "train.lr=3e-3")
    trainer = Trainer(cfg)
    from flowrl.checkpoint import find_checkpoint
    from safetensors.torch import load_file

    # the reference holds the teacher's LoRA weights, and the trained weights are still the student's (zero B)
    saved = load_file(str(find_checkpoint(teacher) / "pytorch_lora_weights.safetensors"))
    assert sum(float(v.abs().sum()) for k, v in saved.items() if "lora_B" in k) > 0
    assert sum(float(a.abs().sum()) for a in trainer.policy.anchor) > sum(
        float(p.detach().abs().sum()) for p in trainer.policy.params)
    rows = [trainer.iteration(i) for i in range(4)]
    assert all(r["policy_loss"] == 0.0 for r in rows)  # reward_weight 0: no reward term in the loss
    assert rows[0]["ratio_max_abs_dev_first_update"] < 1e-5
    kls = [r["kl_loss"] for r in rows]
    assert kls[0] > 0 and kls[-1] < 0.8 * kls[0], kls  # the KL to the teacher falls as the student learns


def test_the_loss_is_the_gaussian_kl_by_hand():
    from flowrl.losses import gaussian_kl_same_std

    mu, mu_t, std = torch.tensor([[0.5, -0.5]]), torch.tensor([[0.3, -0.1]]), torch.tensor([[0.2, 0.2]])
    # mean over elements of (mu - mu_T)^2 / (2 s^2) = ((0.04 + 0.16) / 2) / 0.08 = 1.25
    assert gaussian_kl_same_std(mu, mu_t, std).tolist() == pytest.approx([1.25])


def test_needs_a_teacher_and_a_coefficient(tmp_path):
    from flowrl.config import load_config
    from flowrl.errors import ConfigError, FlowRLError

    with pytest.raises(ConfigError, match="needs the teacher"):
        load_config(None, ["algorithm.name=on_policy_distillation", "train.kl_beta=1"])
    with pytest.raises(ConfigError, match="set train.kl_beta > 0"):
        load_config(None, ["algorithm.name=on_policy_distillation", f"algorithm.teacher={tmp_path}"])
    from flowrl.trainer import Trainer

    cfg = make_cfg(tmp_path, "algorithm.name=on_policy_distillation", f"algorithm.teacher={tmp_path}",
                   "train.kl_beta=1")
    with pytest.raises(FlowRLError, match="neither a run directory nor a flowrl checkpoint"):
        Trainer(cfg)
    assert not (tmp_path / "t").exists()  # refused before the run folder


def _domains_file(tmp_path, domains):
    import json

    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"prompt {i}", "domain": d}) + "\n" for i, d in enumerate(domains)))
    return path


def test_each_prompt_is_pulled_toward_its_domains_teacher(tmp_path):
    """algorithm.teachers: one teacher per value of the prompts' metadata field ``domain_key``. All prompts of one
    domain: the same run as that teacher alone (bit for bit); mixed domains: both teachers are used."""
    from safetensors.torch import load_file

    from flowrl.checkpoint import find_checkpoint
    from flowrl.trainer import Trainer

    teachers = {d: Trainer(make_cfg(tmp_path / f"teacher_{d}", *BASE, "train.iterations=1", "train.lr=3e-2",
                                    f"train.seed={s}")).train() for d, s in (("ocr", 0), ("count", 1))}
    both = f"algorithm.teachers={{ocr: {teachers['ocr']}, count: {teachers['count']}}}"

    def student(name, domains, *teacher):
        cfg = make_cfg(tmp_path / name, *BASE, "algorithm.name=on_policy_distillation", "train.kl_beta=1.0",
                       f"data.prompt_file={_domains_file(tmp_path / name, domains)}", *teacher)
        return Trainer(cfg)

    (tmp_path / "mixed").mkdir()
    mixed = student("mixed", ["ocr", "count", "count", "ocr"], both)
    for d in ("ocr", "count"):  # each reference holds its teacher's LoRA weights
        saved = load_file(str(find_checkpoint(teachers[d]) / "pytorch_lora_weights.safetensors"))
        lora_b = sorted(float(v.abs().sum()) for k, v in saved.items() if "lora_B" in k)
        names = [n for n, _ in mixed.policy.module.named_parameters() if "lora_" in n]
        held = sorted(float(a.abs().sum()) for n, a in zip(names, mixed.policy.anchors[d]) if "lora_B" in n)
        assert held == pytest.approx(lora_b, rel=1e-6) and sum(lora_b) > 0
    row = mixed.iteration(0)
    mixed_kl = row["kl_loss"]
    from flowrl.memory import estimate  # flowrl memory counts both teachers' copies of the trained weights

    assert estimate(mixed.cfg, [1])["per_process_gib"][0]["anchors"] * 1024 == pytest.approx(
        row["memory/anchors_mb"], rel=1e-6) and row["memory/anchors_mb"] > 0
    one_domain = {}
    for d in ("ocr", "count"):
        (tmp_path / f"only_{d}").mkdir()
        routed = student(f"only_{d}", [d] * 4, both).iteration(0)
        (tmp_path / f"single_{d}").mkdir()
        single = student(f"single_{d}", [d] * 4, f"algorithm.teacher={teachers[d]}").iteration(0)
        assert routed["kl_loss"] == single["kl_loss"] and routed["grad_norm"] == single["grad_norm"]
        one_domain[d] = single["kl_loss"]
    assert one_domain["ocr"] != one_domain["count"]  # the teachers differ
    assert mixed_kl not in one_domain.values()


def test_teachers_refuse_a_domain_without_a_teacher_before_any_work(tmp_path):
    from flowrl.config import load_config
    from flowrl.errors import ConfigError
    from flowrl.trainer import Trainer

    with pytest.raises(ConfigError, match="give algorithm.teacher or algorithm.teachers, not both"):
        load_config(None, ["algorithm.name=on_policy_distillation", "train.kl_beta=1", f"algorithm.teacher={tmp_path}",
                           f"algorithm.teachers={{a: {tmp_path}}}"])
    teacher = Trainer(make_cfg(tmp_path / "teacher", *BASE, "train.iterations=1")).train()
    cfg = make_cfg(tmp_path / "student", *BASE, "algorithm.name=on_policy_distillation", "train.kl_beta=1",
                   f"data.prompt_file={_domains_file(tmp_path, ['ocr', 'art'])}", f"algorithm.teachers={{ocr: {teacher}}}")
    with pytest.raises(ConfigError, match="prompt 'prompt 1' has domain 'art', which has no teacher; add it to "
                                          "algorithm.teachers"):
        Trainer(cfg)
    assert not (tmp_path / "student" / "t").exists()  # refused before the run folder
