"""Bad input ends in one clear line naming what to change, before any output is written."""

import pytest

from flowrl.cli import main
from flowrl.config import load_config
from flowrl.errors import ConfigError, RewardError


@pytest.mark.parametrize("override,message", [
    ("train.lrr=1", "unknown config key 'train.lrr'; did you mean 'train.lr'?"),
    ("algorithm.window.sise=2", "did you mean 'algorithm.window.size'?"),
    ("train.lr=fast", "train.lr: expected a number, got 'fast'"),
    ("train.iterations=2.5", "train.iterations: expected an integer"),
    ("algorithm.group_size=1", "algorithm.group_size: 1 is out of range; it must be >= 2"),
    ("sampler.kernel=flowgrpo", "did you mean 'flow_grpo'?"),
    ("train.lora.enabled=maybe", "train.lora.enabled: expected true or false"),
    ("rewards=[]", "rewards: list at least one reward"),
    ("algorithm.name=flow_grpo_fast", "algorithm.window.size: flow_grpo_fast needs a window"),
    ("algorithm.name=dance_grpo algorithm.window.size=12", "algorithm.window.size: a window of 12 does not fit"),
])
def test_bad_overrides(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, override.split())
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_yaml_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  lr: [1,\n")
    with pytest.raises(ConfigError, match="invalid YAML at line"):
        load_config(bad)
    typo = tmp_path / "typo.yaml"
    typo.write_text("sampler:\n  num_step: 10\n")
    with pytest.raises(ConfigError, match="did you mean 'sampler.num_steps'"):
        load_config(typo)


def test_float_strings_from_yaml_are_numbers(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  lr: 1e-4\n")  # YAML 1.1 reads this as a string
    assert load_config(f).train.lr == 1e-4


def run_cli(args, capsys):
    code = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


def test_cli_errors_are_one_line_and_write_nothing(tmp_path, capsys):
    out = tmp_path / "runs"
    cases = [
        (["train", f"log.output_dir={out}", "train.lrr=1"], "did you mean 'train.lr'"),
        (["train", f"log.output_dir={out}", "data.prompts=[]", "model.pretrained=/nonexistent/model"],
         "the prompt list is empty"),
        (["train", f"log.output_dir={out}", "data.prompts=[a cat]", "model.pretrained=/nonexistent/model"],
         "model.pretrained: cannot load SD3 pipeline '/nonexistent/model'"),
        (["train", f"log.output_dir={out}", f"data.prompt_file={tmp_path}/missing.txt"], "file not found"),
        (["train", f"log.output_dir={out}", "rewards=[{name: jpeg_compressibilty}]"], "did you mean 'jpeg_compressibility'"),
        (["train", f"log.output_dir={out}", "rewards=[{name: nosuchmodule:fn}]"], "cannot import module"),
        (["train", str(tmp_path / "missing.yaml")], "config file not found"),
    ]
    for args, expected in cases:
        code, err = run_cli(args, capsys)
        assert code == 2, args
        assert len(err) == 1 and err[0].startswith("flowrl: error:"), err
        assert expected in err[0]
    assert not out.exists()


def test_empty_prompt_file(tmp_path, capsys):
    f = tmp_path / "p.txt"
    f.write_text("\n\n")
    code, err = run_cli(["train", f"log.output_dir={tmp_path / 'r'}", f"data.prompt_file={f}"], capsys)
    assert code == 2 and "holds no prompts" in err[0]


def test_reward_wrong_shape_and_nan(tmp_path):
    import torch

    from flowrl.rewards import build_reward_set
    from flowrl.config import RewardSpec

    rs = build_reward_set([RewardSpec(name="tests.helpers:wrong_shape")])
    with pytest.raises(RewardError, match=r"returned shape \(3, 2\); it must return one score per image, shape \(3,\)"):
        rs(torch.zeros(3, 3, 8, 8), ["a"] * 3)
    rs = build_reward_set([RewardSpec(name="tests.helpers:half_nan"), RewardSpec(name="jpeg_incompressibility", weight=0.5)])
    scores = rs(torch.zeros(4, 3, 8, 8), ["a"] * 4)
    assert scores.invalid.tolist() == [True, False, True, False]
    assert torch.isnan(scores.total[0]) and torch.isfinite(scores.total[1])
    assert set(scores.components) == {"half_nan", "jpeg_incompressibility"}


def test_indexed_overrides_edit_reward_lists():
    from flowrl.config import load_config

    cfg = load_config(None, ["rewards[0].weight=2", "rewards[1].name=shapes", "rewards[1].weight=0.5"])
    assert [(r.name, r.weight) for r in cfg.rewards] == [("jpeg_compressibility", 2.0), ("shapes", 0.5)]
    with pytest.raises(ConfigError, match="index 3 would leave a gap"):
        load_config(None, ["rewards[3].name=shapes"])
    with pytest.raises(ConfigError, match="rewards\\[0\\].wieght"):
        load_config(None, ["rewards[0].wieght=2"])
