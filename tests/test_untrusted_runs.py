"""Reading a run someone sent you runs none of its code, and no command deletes a folder it did not write.

A saved run's config.yaml can name ``module:attribute`` plug-ins (a reward, an evaluator, a family). ``eval``,
``sample``, ``export`` and ``eval --compare`` on that run import none of them unless the user types the name or
passes ``--allow-plugins``; the crafted configs below would create a marker file if anything ran."""

import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from flowrl.cli import main

ROOT = Path(__file__).resolve().parent.parent
FAST = ["sampler.num_steps=2", "train.prompts_per_iter=1", "algorithm.group_size=2", "log.progress=false",
        "log.sample_every=0", "guard.enabled=false"]


def cli(capsys, *args):
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err.strip().splitlines()


def one_error(err, expected):
    errors = [e for e in err if e.startswith("flowrl: error:")]
    assert len(errors) == 1 and not any("Traceback" in e for e in err), err
    assert expected in errors[0], errors[0]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    assert main(["train", str(ROOT / "configs/tiny_flow_grpo.yaml"), f"log.output_dir={out}", "log.run_name=r",
                 *FAST, "train.iterations=1"]) == 0
    return out / "r"


def crafted_run(finished_run, tmp_path, rewards=None, section=None, name=None) -> Path:
    """A copy of the finished run whose config.yaml names ``rewards``, or ``name`` in ``section`` (what an attacker
    would send)."""
    run = tmp_path / "sent" / "r"
    shutil.copytree(finished_run, run)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    if rewards is not None:
        cfg["rewards"] = rewards
    if section is not None:
        cfg[section] = {**cfg[section], "name" if section == "algorithm" else "family": name}
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    return run


# --------------------------------------------------------------------- O: a run's config runs no code
def test_eval_of_a_sent_run_does_not_run_the_command_its_config_names(finished_run, tmp_path, capsys):
    marker = tmp_path / "pwned"
    run = crafted_run(finished_run, tmp_path, [{"name": "subprocess:Popen", "weight": 1.0,
                                                "args": {"args": ["touch", str(marker)]}}])
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle on a blue background\n")
    code, err = cli(capsys, "eval", "--checkpoint", run, "--prompts", prompts, "--csv", tmp_path / "e.csv")
    assert code == 2
    one_error(err, "'subprocess:Popen' comes from")
    assert "--allow-plugins" in err[-1]
    code, err = cli(capsys, "eval", "--compare", run, "base", "--prompts", prompts, "--csv", tmp_path / "c.csv")
    assert code == 2
    one_error(err, "'subprocess:Popen' comes from")
    assert not marker.exists()


@pytest.mark.parametrize("command, section", [("export", "algorithm"), ("sample", "algorithm"), ("export", "model"),
                                              ("sample", "model")])
def test_a_module_inside_the_run_folder_is_not_imported_from_there(finished_run, tmp_path, capsys, monkeypatch,
                                                                    command, section):
    marker = tmp_path / "pwned"
    run = crafted_run(finished_run, tmp_path, section=section, name="sent_module_xyz:Thing")
    (run / "sent_module_xyz.py").write_text(f"open({str(marker)!r}, 'w').close()\nThing = object\n")
    monkeypatch.chdir(run)
    path_before = list(sys.path)
    if command == "export":
        code, err = cli(capsys, "export", ".", "--out", tmp_path / "exported")
    else:
        code, err = cli(capsys, "sample", "--checkpoint", ".", "--out", tmp_path / "s.png", "--seeds", "0")
    assert code == 2
    one_error(err, "'sent_module_xyz:Thing' comes from")
    assert not marker.exists() and "sent_module_xyz" not in sys.modules
    assert not (tmp_path / "exported").exists()
    assert sys.path == path_before


def test_a_name_the_user_types_or_allows_is_imported(finished_run, tmp_path, capsys):
    run = crafted_run(finished_run, tmp_path, [{"name": "tests.helpers:brightness", "weight": 1.0}])
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle on a blue background\n")
    base = ["eval", "--checkpoint", run, "--prompts", prompts, "--seeds", "0", "--steps", "2"]
    code, err = cli(capsys, *base, "--csv", tmp_path / "refused.csv")
    assert code == 2
    one_error(err, "'tests.helpers:brightness' comes from")
    assert cli(capsys, *base, "--csv", tmp_path / "allowed.csv", "--allow-plugins")[0] == 0
    assert cli(capsys, *base, "--csv", tmp_path / "typed.csv", "--reward", "tests.helpers:brightness")[0] == 0
    rows = (tmp_path / "allowed.csv").read_text()
    assert "brightness" in rows


def test_a_plug_in_import_leaves_sys_path_as_it_was(tmp_path, monkeypatch):
    from flowrl.registry import Registry

    (tmp_path / "here_module_abc.py").write_text("VALUE = 7\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    before = list(sys.path)
    assert Registry("thing").resolve("here_module_abc:VALUE") == 7
    assert sys.path == before


# --------------------------------------------------------------------- Y: no folder deleted
def test_pretrain_never_deletes_an_existing_export_folder(tmp_path, capsys):
    folder = tmp_path / "mine"
    (folder / "sub").mkdir(parents=True)
    (folder / "photo.jpg").write_bytes(b"precious")
    (folder / "sub" / "notes.txt").write_text("keep")
    before = {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    for command in ("pretrain-tiny-edit", "pretrain-tiny", "pretrain-tiny-clip", "pretrain-tiny-video"):
        work = [] if command == "pretrain-tiny-clip" else ["--work-dir", tmp_path / "w"]
        code, err = cli(capsys, command, *work, "--steps", "1", "--export-dir", folder)
        assert code == 2, command
        one_error(err, f"--export-dir {folder}: exists and is not an earlier export of this command")
    assert {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before
    assert not (tmp_path / "w").exists()  # refused before any work
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_an_export_replaces_only_an_earlier_export(tmp_path):
    from flowrl.errors import FlowRLError
    from flowrl.shapes.pretrain import check_replaceable, fresh_sibling, replace_folder

    earlier = tmp_path / "model"
    (earlier / "transformer").mkdir(parents=True)
    (earlier / "pretrain.json").write_text("{}")
    check_replaceable(earlier, "--export-dir")  # an earlier export: replaced
    tmp = fresh_sibling(earlier)
    (tmp / "pretrain.json").write_text('{"new": 1}')
    replace_folder(tmp, earlier, "--export-dir")
    assert (earlier / "pretrain.json").read_text() == '{"new": 1}' and not tmp.exists()
    (earlier / "mine.txt").write_text("x")  # now it holds a file of the user's: never replaced
    with pytest.raises(FlowRLError, match="holds mine.txt"):
        check_replaceable(earlier, "--export-dir")
    tmp = fresh_sibling(earlier)
    with pytest.raises(FlowRLError):
        replace_folder(tmp, earlier, "--export-dir")
    assert (earlier / "mine.txt").exists() and not tmp.exists()
    # a folder named like the old temporary one is the user's and is not touched
    (tmp_path / "model.tmp").mkdir()
    (tmp_path / "model.tmp" / "keep").write_text("k")
    fresh_sibling(earlier)
    assert (tmp_path / "model.tmp" / "keep").read_text() == "k"


@pytest.mark.parametrize("option, value, expected", [
    ("--save-every", "0", "--save-every: 0 must be at least 1"),
    ("--batch", "0", "--batch: 0 must be at least 1"),
    ("--batch", "-2", "--batch: -2 must be at least 1"),
    ("--lr", "nan", "--lr: nan must be a positive number"),
    ("--seed", "99999999999999999999", "--seed: 99999999999999999999 is not a seed"),
    ("--steps", "-1", "--steps: -1 must be at least 1"),
    ("--eval-every", "-3", "--eval-every: -3 must be 0 or more"),
])
def test_pretrain_numbers_are_checked_before_work(tmp_path, capsys, option, value, expected):
    code, err = cli(capsys, "pretrain-tiny-edit", "--work-dir", tmp_path / "w", "--export-dir", tmp_path / "x",
                    option, value)
    assert code == 2
    assert len(err) == 1 and expected in err[0], err
    assert not (tmp_path / "w").exists() and not (tmp_path / "x").exists()


# --------------------------------------------------------------------- U: digests checked, not assumed
def _flip_to_nan(path: Path) -> None:
    """Overwrite the first float32 of the file's first tensor with a NaN (what a flipped exponent byte can give)."""
    import json as _json

    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = _json.loads(raw[8:8 + n])
    first = next(v for k, v in header.items() if k != "__metadata__")
    start = 8 + n + first["data_offsets"][0]
    raw[start:start + 4] = bytes.fromhex("0000c07f")  # float32 NaN, little-endian
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("digests", ["entry removed", "empty"])
def test_weights_without_a_digest_are_checked_and_non_finite_ones_refused(finished_run, tmp_path, capsys, digests):
    import json as _json

    run = tmp_path / "r"
    shutil.copytree(finished_run, run)
    ckpt = run / "checkpoints" / "iter_00000"
    weights = ckpt / "pytorch_lora_weights.safetensors"
    record = _json.loads((ckpt / "digests.json").read_text())
    record = {} if digests == "empty" else {k: v for k, v in record.items() if k != weights.name}
    (ckpt / "digests.json").write_text(_json.dumps(record))
    code, err = cli(capsys, "export", run, "--out", tmp_path / "lora")  # whole, unverified: used with a warning
    assert code == 0 and any("has no digest" in e and "every tensor in it is finite" in e for e in err)
    _flip_to_nan(weights)
    code, err = cli(capsys, "export", ckpt, "--out", tmp_path / "nan")
    assert code == 2 and not (tmp_path / "nan").exists()
    one_error(err, "has no digest in digests.json and holds non-finite values")


def test_a_digest_naming_a_file_outside_the_checkpoint_is_named(finished_run, tmp_path, capsys):
    import json as _json

    run = tmp_path / "r"
    shutil.copytree(finished_run, run)
    ckpt = run / "checkpoints" / "iter_00000"
    for name in ("/etc/passwd", "../../config.yaml"):
        (ckpt / "digests.json").write_text(_json.dumps({name: "0" * 64}))
        code, err = cli(capsys, "export", ckpt, "--out", tmp_path / "x")
        assert code == 2
        one_error(err, f"digests.json names {name!r}, which is not a file inside the checkpoint")


# --------------------------------------------------------------------- AA: checks on what the launch turns on
def test_a_refusal_that_reads_fsdp_sees_what_an_fsdp_launch_turns_on(monkeypatch):
    from flowrl.config import load_config
    from flowrl.errors import ConfigError
    from flowrl.sharding import launch_config

    cfg = load_config(ROOT / "configs/tiny_flow_grpo.yaml", ["train.update_composition=rollout"])  # fine alone
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    with pytest.raises(ConfigError, match=r"under this accelerate launch \(FSDP2 on\): "
                                          r"train.update_composition=rollout: .*train.fsdp.enabled"):
        launch_config(cfg)
    assert launch_config(load_config(ROOT / "configs/tiny_flow_grpo.yaml")).train.fsdp.enabled


# --------------------------------------------------------------------- V: the right hint
def test_a_truncated_jpeg_source_is_named_as_an_unreadable_image(tmp_path):
    from PIL import Image

    from flowrl.editing import check_source
    from flowrl.errors import ConfigError

    full = tmp_path / "full.jpg"
    Image.new("RGB", (64, 64), (10, 200, 30)).save(full, quality=95)
    cut = tmp_path / "cut.jpg"
    cut.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    check_source(str(full), "source")
    with pytest.raises(ConfigError, match=r"(?i)source: cannot read source image .*cut.jpg \(.*truncated.*\); give a "
                                          r"whole PNG, JPEG or WebP file") as err:
        check_source(str(cut), "source")
    assert "free space" not in str(err.value)


# --------------------------------------------------------------------- R: plug-ins checked for what they are
@pytest.mark.parametrize("override, expected", [
    ("algorithm.name=math:pi", "algorithm.name: 'math:pi' is float, not an algorithm class"),
    ("algorithm.name=tests.test_untrusted_runs:crafted_run", "is crafted_run, not an algorithm class"),
    ("model.family=math:sqrt", "model.family: 'math:sqrt' is sqrt, not a model adapter class"),
    ("log.eval=os.path:join", "log.eval: 'os.path:join' is join, not an evaluator class"),
    ("data.prompt_set=math:pi", "data.prompt_set: 'math:pi' is float, not a function returning prompts"),
    ("algorithm.name=nosuchmodule_zz:X", "algorithm.name: cannot import module 'nosuchmodule_zz'"),
    ("rewards=[{name: 'math:pi'}]", "reward: 'math:pi' is float, not a reward"),
])
def test_a_plug_in_that_is_not_what_its_key_needs_is_one_line(tmp_path, capsys, override, expected):
    code, err = cli(capsys, "train", ROOT / "configs/tiny_flow_grpo.yaml", f"log.output_dir={tmp_path}", *FAST,
                    override)
    assert code == 2
    one_error(err, expected)
    assert not any(tmp_path.iterdir())


def test_a_module_that_fails_as_it_loads_is_named(tmp_path, capsys, monkeypatch):
    (tmp_path / "broken_plugin_qq.py").write_text("raise RuntimeError('half-written plug-in')\n")
    monkeypatch.chdir(tmp_path)
    code, err = cli(capsys, "train", ROOT / "configs/tiny_flow_grpo.yaml", f"log.output_dir={tmp_path / 'runs'}",
                    *FAST, "algorithm.name=broken_plugin_qq:X")
    assert code == 2
    one_error(err, "importing module 'broken_plugin_qq' failed: RuntimeError: half-written plug-in")


def test_a_broken_plug_in_command_leaves_every_other_command_working(capsys, monkeypatch):
    from flowrl.registry import COMMANDS

    def broken(sub):
        raise RuntimeError("its parser is broken")

    monkeypatch.setitem(COMMANDS, "broken-commands", broken)
    assert main(["presets"]) == 0
    assert "the plug-in commands 'broken-commands' are left out: its parser is broken" in capsys.readouterr().err


# --------------------------------------------------------------------- P and Q: guard inputs, before any work
@pytest.mark.parametrize("override, expected", [
    ("guard.prompt_set=nosuch_set", "guard.prompt_set: unknown prompt set 'nosuch_set'"),
    ("guard.seeds=[99999999999999999999]", "guard.seeds: seed 99999999999999999999 is outside"),
    ("guard.seeds=[-1, 0]", "guard.seeds: seed -1 is outside"),
    ("guard.seeds=[]", "guard.seeds: [] gives each prompt fewer than two samples"),
    ("guard.seeds=[3]", "guard.seeds: [3] gives each prompt fewer than two samples"),
    ("guard.watched=[{name: nosuch}]", "guard.watched: reward: unknown name 'nosuch'"),
    ("guard.watched=[{name: 'math:pi'}]", "guard.watched: reward: 'math:pi' is float, not a reward"),
])
def test_guard_inputs_are_refused_before_a_model_loads(tmp_path, capsys, override, expected):
    code, err = cli(capsys, "train", ROOT / "configs/tiny_flow_grpo.yaml", f"log.output_dir={tmp_path}",
                    *[f for f in FAST if not f.startswith("guard.")], "train.iterations=30", override)
    assert code == 2
    one_error(err, expected)
    assert not any(tmp_path.iterdir())
