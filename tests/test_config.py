"""Bad input ends in one clear line naming what to change, before any output is written."""

from pathlib import Path

import pytest
import yaml

from flowrl.cli import main
from flowrl.config import load_config
from flowrl.errors import ConfigError, RewardError

ROOT = Path(__file__).resolve().parent.parent


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


def test_algorithm_checks_fail_at_load_in_one_line_and_write_nothing(tmp_path, capsys):
    """Checks that used to run in iteration 0 (after the model load, the run folder and the 'before' evaluation)
    now run when the config is loaded."""
    out = tmp_path / "runs"
    base = ["train", f"log.output_dir={out}", "data.prompts=[a cat]"]
    cases = [
        (["configs/tiny_branch_grpo.yaml", "algorithm.group_size=8"],
         "algorithm.group_size (8) must equal trees_per_prompt x branch_factor ** len(split_steps) = 1 x 2^4 = 16"),
        (["configs/tiny_branch_grpo.yaml", "algorithm.split_steps=[0, 25]"], "algorithm.split_steps: steps [25] are outside"),
        (["configs/tiny_e_grpo.yaml", "algorithm.merge=list", "algorithm.merge_lengths=[1, 2]"],
         "algorithm.merge_lengths needs one length per active step (8"),
        (["configs/tiny_e_grpo.yaml", "algorithm.steps=[14]", "algorithm.merge=list", "algorithm.merge_lengths=[3]"],
         "algorithm.merge_lengths: step 14 cannot merge 3 steps (1..2)"),
        (["configs/tiny_chunk_grpo.yaml", "algorithm.sizes=[2, 3]"],
         "algorithm.sizes [2, 3] must be positive and sum to the 16 trained transitions"),
        (["configs/tiny_tempflow_grpo.yaml", "algorithm.steps=[0, 0]"], "repeat a step"),
        (["configs/tiny_superflow.yaml", "algorithm.min_group=9"], "algorithm.min_group (9) must not exceed max_group (8)"),
        (["configs/tiny_flow_grpo.yaml", "algorithm.split_steps=[0]"],
         "algorithm.split_steps: not an option of flow_grpo"),
        (["configs/tiny_flow_grpo.yaml", "algorithm.max_batch=4"], "algorithm.max_batch: not an option of flow_grpo"),
        (["configs/tiny_flow_grpo.yaml", "algorithm.name=flow_grp"], "did you mean 'flow_grpo'?"),
    ]
    for extra, expected in cases:
        code, err = run_cli([base[0], extra[0], *base[1:], *extra[1:]], capsys)
        assert code == 2, extra
        assert len(err) == 1 and err[0].startswith("flowrl: error:"), err
        assert expected in err[0], err[0]
    assert not out.exists()


def test_saved_config_holds_only_the_algorithms_options(tmp_path):
    import yaml

    from flowrl.config import save_config

    cfg = load_config(ROOT / "configs/tiny_flow_grpo.yaml")
    save_config(cfg, tmp_path / "c.yaml")
    algo = yaml.safe_load((tmp_path / "c.yaml").read_text())["algorithm"]
    assert set(algo) == {"name", "group_size", "shared_noise", "antithetic", "window", "timestep_fraction"}
    assert load_config(tmp_path / "c.yaml") == cfg  # and it loads back to the same config
    branch = load_config(ROOT / "configs/tiny_branch_grpo.yaml")
    save_config(branch, tmp_path / "b.yaml")
    keys = set(yaml.safe_load((tmp_path / "b.yaml").read_text())["algorithm"])
    assert "split_steps" in keys and not keys & {"timestep_fraction", "rho", "merge_lengths", "sizes"}


def test_a_plugged_in_algorithm_by_module_and_class(tmp_path):
    """algorithm.name: module:Class plugs a user's algorithm in, with its own options and checks."""
    cfg = load_config(None, ["algorithm.name=tests.helpers:EveryOtherStep", "algorithm.stride=3",
                             "sampler.num_steps=6"])
    from flowrl.algorithms import make_algorithm

    plan = make_algorithm(cfg).plan(0)
    assert [s.trained for s in plan.steps] == [True, False, False, True, False, False]
    with pytest.raises(ConfigError, match="algorithm.stride: 7 leaves no trained step after step 0"):
        load_config(None, ["algorithm.name=tests.helpers:EveryOtherStep", "algorithm.stride=7",
                           "sampler.num_steps=6"])


def test_a_nested_section_under_algorithm_is_refused_with_the_algorithm_s_options():
    """algorithm options are flat: a nested mapping is an unknown key, named with the options the method has."""
    with pytest.raises(ConfigError, match=r"algorithm.tree: not an option of branch_grpo; .*its options: .*split_steps"):
        load_config(ROOT / "configs/tiny_branch_grpo.yaml", ["algorithm.tree.split_steps=[0, 1]"])


def _yaml12(text: str):
    """YAML as an editor's YAML 1.2 reads it: `1e-4` is a number (PyYAML's 1.1 rules read it as a string)."""
    import re

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
                                 list("-+0123456789."))
    return yaml.load(text, Loader=Loader)


def test_config_schema_validates_every_shipped_preset_and_catches_bad_ones(capsys):
    """`flowrl config schema` is a JSON Schema (draft 2020-12) that accepts every preset and rejects what
    load_config rejects: an unknown key, a value out of range or not among the choices, another algorithm's
    option."""
    import json

    import jsonschema

    from flowrl.cli import main

    assert main(["config", "schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    presets = sorted((ROOT / "configs").glob("*.yaml"))
    assert len(presets) > 50
    for path in presets:
        errors = [e.message for e in validator.iter_errors(_yaml12(path.read_text()))]
        assert errors == [], (path.name, errors[:3])
    train = schema["properties"]["train"]
    train = schema["$defs"][train["$ref"].rsplit("/", 1)[-1]] if "$ref" in train else train
    assert train["properties"]["kl_beta"]["description"].startswith("KL to the reference")
    for bad in ({"train": {"kl_bta": 0.1}}, {"train": {"clip_range": 0}}, {"sampler": {"kernel": "ddim"}},
                {"algorithm": {"name": "flow_grpo", "beta": 1.0}}, {"algorithm": {"name": "no_such"}}):
        assert not validator.is_valid(bad), bad
        with pytest.raises(ConfigError):
            load_config(None, [f"{k}.{kk}={vv}" for k, v in bad.items() for kk, vv in v.items()])
    assert validator.is_valid({"algorithm": {"name": "diffusion_nft", "beta": 0.1}})


def test_config_explain_prints_type_default_range_and_description(capsys):
    from flowrl.cli import main

    assert main(["config", "explain", "train.kl_beta"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "train.kl_beta", "  type: float", "  default: 0.0", "  range: >= 0.0",
        "  KL to the reference policy (train.kl_reference)"]
    assert main(["config", "explain", "sampler.kernel"]) == 0
    assert "  choices: flow_grpo, dance, cps" in capsys.readouterr().out
    assert main(["config", "explain", "algorithm.beta"]) == 0
    assert capsys.readouterr().out.startswith("algorithm.beta (an option of diffusion_nft, sol_rl)\n  type: float\n  default: 1.0")
    assert main(["config", "explain", "train.kl_bta"]) == 2
    assert capsys.readouterr().err.strip() == "flowrl: error: unknown config key 'train.kl_bta'; did you mean 'train.kl_beta'?"


def test_algorithm_advantage_defaults_yield_to_the_config():
    """BranchGRPO's released ddof 1 and eps 1e-8 replace the package's where the config leaves them out."""
    from flowrl.config import load_config

    c = load_config(None, ["algorithm.name=branch_grpo", "sampler.num_steps=10"])
    assert (c.advantage.ddof, c.advantage.eps, c.advantage.zero_std_threshold) == (1, 1e-8, 1e-6)
    c = load_config(None, ["algorithm.name=branch_grpo", "sampler.num_steps=10", "advantage.ddof=0"])
    assert (c.advantage.ddof, c.advantage.eps) == (0, 1e-8)
    assert load_config(None, []).advantage.ddof == 0
