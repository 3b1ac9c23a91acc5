"""The ``ocr`` reward with the real RapidOCR model (its wheel carries PP-OCRv4) on text PIL renders, and prompt sets
read as Hugging Face datasets (``data.dataset``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.conftest import make_cfg


def render(text: str, size=(256, 96)) -> torch.Tensor:
    """Black text on white, (3, H, W) in [0, 1]."""
    from PIL import Image, ImageDraw, ImageFont

    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).text((10, 25), text, fill="black", font=ImageFont.load_default(size=36))
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255


@pytest.fixture(scope="module")
def ocr():
    from flowrl.rewards import build_reward

    return build_reward("ocr")


def test_the_ocr_reward_reads_rendered_text_and_scores_the_edit_distance(ocr):
    images = torch.stack([render("Hello World"), render("Helo World"), torch.ones(3, 96, 256), render("flowrl")])
    prompts = ['a sign that says "Hello World"'] * 3 + ['a poster with the word "FlowRL" on it']
    scores = ocr(images, prompts, [{}] * 4)
    # exact text: 1; one letter missing from the 10 letters of "helloworld": 1 - 1/10; nothing read: 0;
    # case and spaces do not count
    assert scores.tolist() == pytest.approx([1.0, 0.9, 0.0, 1.0], abs=1e-6)
    assert ocr(images[:1], ["a sign"], [{"text": "Goodbye"}]).item() < 0.5  # metadata's text overrides the quotes


def test_text_scores_follow_the_published_conventions():
    from flowrl.rewards.ocr import target_text, text_score

    assert target_text('a cafe sign reading "Open 24 Hours" at night') == "Open 24 Hours"
    assert target_text("no quotes here") == "no quotes here"
    assert text_score("WELCOME to open24hours!", "Open 24 Hours") == 1.0  # contained: extra text costs nothing
    assert text_score("opne", "open") == pytest.approx(1 - 2 / 4)  # a swap is two edits
    assert text_score("completely different words", "open") == 0.0  # the distance is capped at the length
    assert np.isnan(text_score("anything", "  "))


def test_one_training_iteration_on_the_ocr_reward(tmp_path):
    from flowrl.trainer import Trainer

    cfg = make_cfg(tmp_path, "rewards[0].name=ocr", "sampler.num_steps=4", "train.prompts_per_iter=2",
                   'data.prompts=["a sign that says \\"Hi\\"", "a label with \\"OK\\""]')
    row = Trainer(cfg).iteration(0)
    assert 0.0 <= row["reward_mean/total"] <= 1.0
    if row["work_items"]:  # groups whose scores differ are trained, with ratio 1 on the first update
        assert row["ratio_max_abs_dev_first_update"] < 1e-5
    else:  # every group's scores equal (no text read on the tiny model): nothing trained, no ratio measured
        assert row["trained_edges"] == 0 and "ratio_max_abs_dev_first_update" not in row


# ----------------------------------------------------------------------------------------- datasets
ROWS = [{"prompt": "a red circle", "category": "shape", "difficulty": 1},
        {"prompt": 'a sign that says "Hi"', "category": "text", "difficulty": 3},
        {"prompt": "a blue square", "category": "shape", "difficulty": 2}]


@pytest.mark.parametrize("kind", ["parquet", "jsonl", "csv", "save_to_disk"])
def test_a_dataset_of_prompts_with_metadata_columns(tmp_path, kind):
    import datasets

    from flowrl.prompts import read_dataset

    table = datasets.Dataset.from_list(ROWS)
    path = tmp_path / f"prompts.{kind}"
    if kind == "parquet":
        table.to_parquet(str(path))
    elif kind == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    elif kind == "csv":
        table.to_csv(str(path), index=False)
    else:
        table.save_to_disk(str(path))
    prompts, meta = read_dataset(str(path))
    assert prompts == [r["prompt"] for r in ROWS]
    assert meta == [{"category": r["category"], "difficulty": r["difficulty"]} for r in ROWS]
    _, only = read_dataset(str(path), metadata_columns=["category"])
    assert only == [{"category": r["category"]} for r in ROWS]


def test_dataset_mistakes_are_one_line(tmp_path):
    from flowrl.config import load_config
    from flowrl.errors import ConfigError
    from flowrl.prompts import PromptSource, read_dataset

    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"caption": r["prompt"], "tag": r["category"]}) for r in ROWS) + "\n")
    with pytest.raises(ConfigError, match=r"data.prompt_column: .* has no column 'prompt' \(its columns: caption, tag\)"):
        read_dataset(str(path))
    with pytest.raises(ConfigError, match=r"data.metadata_columns: .* has no column 'nope'"):
        read_dataset(str(path), prompt_column="caption", metadata_columns=["nope"])
    with pytest.raises(ConfigError, match=r"data.dataset: .xlsx files are not read"):
        (tmp_path / "p.xlsx").write_text("x")
        read_dataset(str(tmp_path / "p.xlsx"))
    cfg = load_config(None, [f"data.dataset={path}", "data.prompt_column=caption"])
    source = PromptSource.from_config(cfg.data, seed=0)
    prompts, meta = source.batch(0, 3)
    assert sorted(prompts) == sorted(r["prompt"] for r in ROWS) and all("tag" in m for m in meta)


def test_flowrl_eval_on_a_dataset_with_two_rewards_writes_csv_summary_and_grid(tmp_path, capsys):
    import csv

    import datasets

    from flowrl.cli import main

    rows = [{"prompt": "a red circle on a blue background", "tag": "shape"},
            {"prompt": "a green square on a white background", "tag": "shape"},
            {"prompt": 'a sign that says "OK"', "tag": "text"}]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "p.parquet"))
    out = tmp_path / "eval" / "t.csv"
    code = main(["eval", "--dataset", str(tmp_path / "p.parquet"), "--reward", "jpeg_compressibility", "--reward",
                 "ocr", "--seeds", "0,1", "--steps", "4", "--csv", str(out), "--group-by", "tag", "log.progress=false"])
    assert code == 0
    for name in ("t.csv", "t_samples.csv", "t_prompts.csv", "t.json", "t_grid.png"):
        assert (tmp_path / "eval" / name).is_file(), name
    per_image = list(csv.DictReader((tmp_path / "eval/t_samples.csv").open()))
    assert len(per_image) == 6 and {"jpeg_compressibility", "ocr", "total"} <= set(per_image[0])
    report = json.loads((tmp_path / "eval/t.json").read_text())
    jpeg = [float(r["jpeg_compressibility"]) for r in per_image]
    assert report["metrics"]["jpeg_compressibility"]["mean"] == pytest.approx(sum(jpeg) / 6)
    shape, text = sum(jpeg[:4]) / 4, sum(jpeg[4:]) / 2  # prompt-major: two seeds per prompt
    per_prompt = list(csv.DictReader((tmp_path / "eval/t_prompts.csv").open()))
    assert [r["prompt"] for r in per_prompt] == [r["prompt"] for r in rows] and per_prompt[0]["images"] == "2"
    assert float(per_prompt[2]["jpeg_compressibility"]) == pytest.approx(text)
    groups = report["groups"]
    assert groups["groups"]["shape"]["jpeg_compressibility"] == pytest.approx(shape)
    assert groups["overall"]["jpeg_compressibility"] == pytest.approx((shape + text) / 2)


def test_flowrl_eval_compare_puts_runs_side_by_side_with_paired_differences(tmp_path):
    import csv

    from flowrl.cli import main

    root = tmp_path / "runs"
    assert main(["train", f"log.output_dir={root}", "log.run_name=a", "train.iterations=2", "log.save_every=1",
                 "log.sample_every=0", "sampler.num_steps=4", "train.prompts_per_iter=2", "log.progress=false",
                 "train.lr=5e-2"]) == 0
    out = tmp_path / "cmp" / "c.csv"
    assert main(["eval", "--compare", "base", str(root / "a"), "--reward", "jpeg_compressibility", "--seeds", "0,1",
                 "--csv", str(out), "log.progress=false"]) == 0
    rows = list(csv.DictReader(out.open()))
    assert [r["metric"] for r in rows] == ["jpeg_compressibility"]
    base, trained = float(rows[0]["base mean"]), float(rows[0]["a mean"])
    assert float(rows[0]["a - base"]) == pytest.approx(trained - base, abs=1e-6)  # every pair scored: means differ
    assert float(rows[0]["a - base se"]) >= 0 and (tmp_path / "cmp/c_grid.png").is_file()
    assert json.loads((tmp_path / "cmp/c.json").read_text())["runs"] == ["base", "a"]


def test_a_dataset_s_relative_source_paths_are_read_beside_it(tmp_path, monkeypatch):
    """A parquet dataset's `source` column with a relative path: the image beside the dataset, whatever the working
    folder (the documented rule, as for prompt files)."""
    import datasets
    from PIL import Image

    from flowrl.prompts import read_dataset

    folder = tmp_path / "data"
    (folder / "img").mkdir(parents=True)
    Image.new("RGB", (8, 8), (200, 10, 10)).save(folder / "img" / "a.png")
    datasets.Dataset.from_list([{"prompt": "make it blue", "source": "img/a.png"}]).to_parquet(str(folder / "d.parquet"))
    monkeypatch.chdir(tmp_path)  # not the dataset's folder
    prompts, _ = read_dataset(str(folder / "d.parquet"))
    assert [str(s) for s in prompts[0].sources] == [str(folder / "img" / "a.png")]
