"""Image editing: edit requests as prompts, editing data with source images (and the one-line errors), the
preservation score and the preservation gate by hand, the shapes edit task's sources, targets and reward, and an
editing run's checks, grids and evaluation."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from flowrl.config import load_config
from flowrl.editing import EditPrompt, load_source, prepend_sources, source_tensor, sources_of
from flowrl.errors import ConfigError, RewardError
from flowrl.prompts import read_dataset, read_prompt_file
from flowrl.rewards.preservation import EditGate, Preservation, pixel_preservation


def png(path, array) -> str:
    Image.fromarray(np.asarray(array, dtype=np.uint8)).save(path)
    return str(path)


def test_an_edit_request_is_its_instruction_and_keeps_its_sources():
    a = EditPrompt("make the shape red", ["x.png"])
    b = EditPrompt("make the shape red", ["y.png"])
    assert str(a) == "make the shape red" and a.sources == ("x.png",) and a.instruction == "make the shape red"
    assert a != b and len({a, b, EditPrompt("make the shape red", ("x.png",))}) == 2  # two sources: two prompts
    assert a != "make the shape red" and sources_of("a plain prompt") == ()
    back = pickle.loads(pickle.dumps([a, b]))
    assert back == [a, b] and back[1].sources == ("y.png",)
    assert json.dumps(a) == '"make the shape red"'  # logs and grids show the instruction


def test_a_prompt_file_with_sources_reads_edit_requests(tmp_path):
    png(tmp_path / "a.png", np.full((8, 8, 3), 200))
    (tmp_path / "edits.jsonl").write_text('{"prompt": "make it blue", "source": "a.png", "tag": 1}\n'
                                          '{"prompt": "a cat"}\n')
    prompts, meta = read_prompt_file(tmp_path / "edits.jsonl")
    assert isinstance(prompts[0], EditPrompt) and prompts[0].sources == (str(tmp_path / "a.png"),)  # beside the file
    assert meta[0] == {"tag": 1} and not isinstance(prompts[1], EditPrompt)
    assert np.asarray(load_source(prompts[0].sources[0], 4)).tolist() == [[[200] * 3] * 4] * 4  # resized


@pytest.mark.parametrize("row, message", [
    ('{"prompt": "p", "source": "missing.png"}', "source image not found: "),
    ('{"prompt": "p", "source": "broken.png"}', "cannot read source image "),
    ('{"prompt": "p", "sources": []}', "'source' must be an image path"),
    ('{"prompt": "p", "source": "nope:spec"}', "unknown name 'nope'"),
])
def test_a_bad_source_is_one_line_before_any_work(tmp_path, row, message):
    (tmp_path / "broken.png").write_bytes(b"not an image")
    (tmp_path / "e.jsonl").write_text(row + "\n")
    with pytest.raises(ConfigError) as err:
        read_prompt_file(tmp_path / "e.jsonl")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_dataset_image_column_gives_edit_requests(tmp_path):
    import datasets

    images = [Image.fromarray(np.full((6, 6, 3), v, dtype=np.uint8)) for v in (10, 250)]
    table = datasets.Dataset.from_dict({"prompt": ["darker", "brighter"], "source": images, "id": [1, 2]},
                                       features=datasets.Features({"prompt": datasets.Value("string"),
                                                                   "source": datasets.Image(),
                                                                   "id": datasets.Value("int64")}))
    table.save_to_disk(str(tmp_path / "ds"))
    prompts, meta = read_dataset(str(tmp_path / "ds"))
    assert [str(p) for p in prompts] == ["darker", "brighter"] and meta == [{"id": 1}, {"id": 2}]
    assert source_tensor(prompts, 6)[:, 0, 0, 0].tolist() == pytest.approx([10 / 255, 250 / 255])


def test_pixel_preservation_by_hand():
    source = torch.full((1, 3, 10, 10), 0.5)
    assert pixel_preservation(source, source).item() == 1.0  # identical: the maximum
    result = source.clone()
    result[:, :, :2] = 0.9  # 20% of the pixels moved by 0.4
    assert pixel_preservation(result, source).item() == pytest.approx(1 - 0.2 * 0.4)
    result[:, :, :4] = 0.9  # 40% of the pixels: twice the loss
    assert pixel_preservation(result, source).item() == pytest.approx(1 - 0.4 * 0.4)
    editable = torch.zeros(1, 10, 10, dtype=torch.bool)
    editable[:, :4] = True  # the mask covers the changed rows: nothing the edit should keep moved
    assert pixel_preservation(result, source, editable).item() == pytest.approx(1.0)
    editable[:, 2:4] = False  # half of the change outside the mask: 20 changed of the 80 kept pixels
    assert pixel_preservation(result, source, editable).item() == pytest.approx(1 - 20 / 80 * 0.4)


def test_the_preservation_reward_reads_sources_and_masks(tmp_path):
    src = np.full((8, 8, 3), 100, dtype=np.uint8)
    prompt = EditPrompt("edit", [png(tmp_path / "s.png", src)])
    mask = np.zeros((8, 8), dtype=np.uint8)
    mask[:4] = 255  # the top half may change
    mask_path = png(tmp_path / "m.png", np.stack([mask] * 3, -1))
    result = torch.from_numpy(src).permute(2, 0, 1)[None].float() / 255
    result[:, :, :4] = 1.0  # the top half repainted white
    reward = Preservation()
    moved = 1 - 0.5 * (1 - 100 / 255)
    assert reward(result, [prompt], [{}])[0] == pytest.approx(moved, abs=1e-6)
    assert reward(result, [prompt], [{"mask": mask_path}])[0] == pytest.approx(1.0)  # outside the mask only
    with pytest.raises(ConfigError, match="has no source image"):
        reward(result, ["a plain prompt"], [{}])


class Fixed:
    """An instruction reward with given values (the gate's input)."""

    def __init__(self, values):
        self.values = np.asarray(values, dtype=np.float64)

    def __call__(self, images, prompts, metadata=None):
        return self.values


def test_the_preservation_gate_by_hand(tmp_path, monkeypatch):
    src = np.full((4, 4, 3), 0, dtype=np.uint8)
    prompts = [EditPrompt("edit", [png(tmp_path / "s.png", src)])] * 3
    images = torch.zeros(3, 3, 4, 4)
    images[1, :, :1] = 1.0  # a quarter of the image repainted: preservation 0.75
    images[2] = 1.0  # everything repainted: preservation 0
    follow = [0.2, 0.6, 0.9]  # the repainting scores best on the instruction (what instruction rewards reward)
    monkeypatch.setattr("tests.test_editing.FOLLOW", Fixed(follow), raising=False)
    spec = {"name": "tests.test_editing:FOLLOW"}
    hard = EditGate(spec, threshold=0.7)(images, prompts)
    assert hard.tolist() == pytest.approx([0.2, 0.6, 0.0])  # kept >= 0.7 counts in full, else `below`
    soft = EditGate(spec, threshold=0.9, floor=0.5, below=-1.0)(images, prompts)
    ramp = (0.75 - 0.5) / (0.9 - 0.5)
    assert soft.tolist() == pytest.approx([0.2, -1 + (0.6 + 1) * ramp, -1.0])
    summed = EditGate(spec, mode="sum", instruction_weight=0.5)(images, prompts)
    assert summed.tolist() == pytest.approx([0.6, 0.675, 0.45])  # the sum still pays the repainting 0.45 > 0
    with pytest.raises(RewardError, match="floor"):
        EditGate(spec, threshold=0.5, floor=0.8)


def test_shapes_edit_requests_targets_and_reward():
    from flowrl.shapes.domain import parse_prompt, render
    from flowrl.shapes.editing import (ShapesEditReward, edit_outcomes, heldout_edit_prompts, source_and_target,
                                       train_edit_prompts)

    train, held = train_edit_prompts(), heldout_edit_prompts()
    assert len(train) == 2 * 200 and len(held) == 3 * 24
    assert {sources_of(p)[0].rpartition("#")[0] for p in held}.isdisjoint({sources_of(p)[0].rpartition("#")[0]
                                                                           for p in train})
    request = EditPrompt("turn the circle into a square", ["shapes:a red circle on a blue background#7"])
    source, attribute, target = source_and_target(request)
    assert attribute == "shape" and target == parse_prompt("a red square on a blue background")
    done = torch.from_numpy(render(target, 32, 7)).permute(2, 0, 1)[None].float() / 255  # the edit, drawn exactly
    untouched = source_tensor([request], 32)
    repainted = torch.from_numpy(render(parse_prompt("a red square on a green background"), 32, 7)).permute(2, 0, 1)
    images = torch.cat([done, untouched, repainted[None].float() / 255])
    outcome = edit_outcomes(images, [request] * 3)
    assert outcome["asked"].tolist() == [True, False, True] and outcome["kept"].tolist() == [True, True, False]
    scores = ShapesEditReward()(images, [request] * 3)
    assert scores[0] > max(scores[1], scores[2]) + 0.05


def test_shapes_edit_reward_parts_by_hand():
    """The asked part scores the asked attribute alone and the kept part the two others: the exact edit earns 1 on
    both; the untouched source earns 0 asked; repainting the shape as well keeps the asked score and loses the kept
    score. The gate with the kept part as its preservation closes on the
    repainting."""
    from flowrl.shapes.domain import parse_prompt, render
    from flowrl.shapes.editing import ShapesEditReward

    request = EditPrompt("make the background yellow", ["shapes:a green square on a blue background#7"])

    def draw(caption):
        return torch.from_numpy(render(parse_prompt(caption), 32, 7)).permute(2, 0, 1)[None].float() / 255

    images = torch.cat([draw("a green square on a yellow background"), draw("a red square on a yellow background"),
                        source_tensor([request], 32)])
    asked = ShapesEditReward(part="asked")(images, [request] * 3)
    kept = ShapesEditReward(part="kept")(images, [request] * 3)
    assert asked.tolist() == pytest.approx([1.0, 1.0, 0.0])
    assert kept[0] > 0.75  # (colour 1 + the square's margin score over the circle's template, 0.6) / 2
    # no green pixel left: colour 0, and the shape (read off the asked colour's mask) scores margin 0, i.e. 0.5
    assert kept[1] == pytest.approx(0.25)
    both = ShapesEditReward(part="all")(images, [request] * 3)
    assert both.tolist() == pytest.approx(((asked + 2 * kept) / 3).tolist())
    gate = EditGate({"name": "shapes_edit", "args": {"part": "asked"}},
                    {"name": "shapes_edit", "args": {"part": "kept"}}, threshold=0.75)
    assert gate(images, [request] * 3).tolist() == pytest.approx([1.0, 0.0, 0.0])
    # read=True: the checker's readout, 1 or 0 per attribute: the exact edit keeps both others (1); the repainted
    # one keeps the square (read off the red mask) but not the colour (0.5); the untouched source keeps both (1)
    read = {part: ShapesEditReward(part=part, read=True)(images, [request] * 3).tolist()
            for part in ("asked", "kept", "all")}
    assert read == {"asked": [1.0, 1.0, 0.0], "kept": [1.0, 0.5, 1.0], "all": pytest.approx([1.0, 2 / 3, 2 / 3])}
    with pytest.raises(RewardError, match="part='some'"):
        ShapesEditReward(part="some")


def test_edit_pairs_keep_the_shape_in_place():
    """The pretraining pairs: the instruction parses to the target the image shows, rendered at the source's size
    and position (only the asked attribute's pixels differ)."""
    import random

    from flowrl.shapes.domain import split_specs
    from flowrl.shapes.editing import target_of
    from flowrl.shapes.pretrain_edit import edit_batch
    from flowrl.shapes.reward import classify

    source, target, texts = edit_batch(split_specs()[0], 24, random.Random(0), 16)
    assert source.shape == target.shape == (24, 3, 16, 16) and source.min() >= -1 and target.max() <= 1
    for s, t, text in zip(classify(source / 2 + 0.5), classify(target / 2 + 0.5), texts):
        from flowrl.shapes.domain import ShapeSpec

        attribute, want = target_of(ShapeSpec(s[2], s[1], s[0]), text)
        assert (t[2], t[1], t[0]) == (want.shape, want.color, want.background)
    shape_edits = [i for i, t in enumerate(texts) if t.startswith("turn")]
    colour_edits = [i for i, t in enumerate(texts) if t.startswith("make the shape")]
    for i in colour_edits:  # same mask: the pixels that changed are exactly the shape's
        changed = (source[i] != target[i]).any(0)
        assert changed.sum() > 0 and torch.equal(changed, (source[i] != source[i][:, :1, :1]).any(0))
    assert shape_edits and colour_edits


def test_imperfect_edit_pairs_miss_or_over_edit_in_their_shares():
    """An imperfect editing dataset's pairs, by hand and read by the checker: ``missed`` pairs show the source
    unchanged, ``over_edited`` pairs the asked change plus the replaced colour leaking into the other colour (a shape
    edit's two colours swap); the shares match the draw within 3 standard errors; no draw is made (the clean stream
    is kept) when both shares are 0."""
    import random

    from flowrl.shapes.domain import ShapeSpec, split_specs
    from flowrl.shapes.editing import target_of
    from flowrl.shapes.pretrain_edit import edit_batch, imperfect_target

    spec, target = ShapeSpec("circle", "red", "blue"), ShapeSpec("square", "red", "blue")
    rng = random.Random(1)
    assert imperfect_target(spec, target, rng, missed=1.0, over_edited=0.0) == spec
    assert imperfect_target(spec, target, rng, missed=0.0, over_edited=1.0) == ShapeSpec("square", "blue", "red")
    recolour = ShapeSpec("circle", "green", "blue")  # "make the shape green": the old red leaks into the background
    assert imperfect_target(spec, recolour, rng, 0.0, 1.0) == ShapeSpec("circle", "green", "red")
    background = ShapeSpec("circle", "red", "white")  # "make the background white": the shape takes the old blue
    assert imperfect_target(spec, background, rng, 0.0, 1.0) == ShapeSpec("circle", "blue", "white")
    assert imperfect_target(spec, target, rng, 0.0, 0.0) == target

    n = 400
    specs = split_specs()[0]
    clean = edit_batch(specs, n, random.Random(0), 16)
    imperfect = edit_batch(specs, n, random.Random(0), 16, missed=0.25, over_edited=0.25)
    assert torch.equal(edit_batch(specs, n, random.Random(0), 16, 0.0, 0.0)[1], clean[1])
    from flowrl.shapes.reward import classify

    reads = [classify(images / 2 + 0.5) for images in (imperfect[0], imperfect[1])]
    outcome = {"missed": 0, "over": 0, "right": 0}
    for (s, t, text) in zip(reads[0], reads[1], imperfect[2]):
        source = ShapeSpec(s[2], s[1], s[0])
        got = ShapeSpec(t[2], t[1], t[0])
        attribute, want = target_of(source, text)
        differs = sum(getattr(got, a) != getattr(source, a) for a in ("shape", "color", "background"))
        if got == source:
            outcome["missed"] += 1
        elif got == want:
            outcome["right"] += 1
        else:
            assert getattr(got, attribute) == getattr(want, attribute)
            assert differs == (3 if attribute == "shape" else 2)  # a shape edit's colours swap
            outcome["over"] += 1
    se = (0.25 * 0.75 / n) ** 0.5
    assert abs(outcome["missed"] / n - 0.25) < 3 * se and abs(outcome["over"] / n - 0.25) < 3 * se


def test_a_pixel_space_kontext_model_reads_its_source_as_pixels(tmp_path):
    """The tiny editing model's layout: no VAE, the source's pixels (in [-1, 1]) are its reference tokens, and an
    exported model loads back as a FluxKontextPipeline with the same velocity (fp16 weights)."""
    from flowrl.models.flux_kontext import FluxKontextAdapter
    from flowrl.models.tiny import load_exported_tiny_flux_kontext
    from flowrl.shapes.pretrain_edit import EDIT_TINY, pretrain_tiny_edit

    out = pretrain_tiny_edit(tmp_path / "w", steps=2, batch=2, eval_every=0, export_dir=tmp_path / "e",
                             progress=False, instruction_dropout=0.5)
    pipe = load_exported_tiny_flux_kontext(out)
    assert type(pipe).__name__ == "FluxKontextPipeline" and pipe.vae is None
    meta = json.loads((out / "pretrain.json").read_text())
    assert meta["steps"] == 2 and meta["instruction_dropout"] == 0.5
    adapter = FluxKontextAdapter(pipe, max_sequence_length=EDIT_TINY.max_tokens, resolution=16)
    request = EditPrompt("make the shape red", ["shapes:a green square on a blue background#7"])
    cond = adapter.encode_prompts([request])
    assert adapter.pixel_space and adapter.latent_shape(16) == (3, 16, 16)
    assert torch.allclose(cond.reference[0, 0], source_tensor([request], 16)[0] * 2 - 1)
    x = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    v = adapter.velocity(x, torch.tensor([0.5]), cond)
    assert v.shape == x.shape and torch.isfinite(v).all()
    other = adapter.encode_prompts([EditPrompt("make the shape red", ["shapes:a green square on a red background#7"])])
    assert not torch.allclose(adapter.velocity(x, torch.tensor([0.5]), other), v)  # the source steers the velocity


def test_grids_put_the_source_first():
    request = EditPrompt("make the shape red", ["shapes:a green circle on a blue background#3"])
    results = torch.rand(2, 3, 32, 32)
    shown = prepend_sources(results, [request], 2)
    assert shown.shape == (3, 3, 32, 32) and torch.equal(shown[0], source_tensor([request], 32)[0])
    assert torch.equal(shown[1:], results)
    plain = torch.rand(2, 3, 8, 8)
    assert prepend_sources(plain, ["a cat"], 2) is plain


def test_an_editing_family_refuses_plain_prompts_and_a_text_family_refuses_edits(tmp_path):
    from flowrl.trainer import Trainer

    base = ["model.resolution=32", "model.tiny.resolution=32", "log.progress=false", f"log.output_dir={tmp_path}"]
    with pytest.raises(ConfigError, match="model.family=flux-kontext edits images: the prompt 'a cat' has no source"):
        Trainer(load_config(None, ["model.family=flux-kontext", "data.prompts=[a cat]", *base]))
    with pytest.raises(ConfigError, match="generates from text alone; use an editing family"):
        Trainer(load_config(None, ["model.family=flux", "data.prompt_set=shapes-edit-train", *base]))
    assert not list(tmp_path.iterdir())  # refused before any run folder


def test_an_editing_run_trains_samples_and_evaluates(tmp_path):
    """Two iterations of the tiny FLUX.1 Kontext model on shapes edits with the gated reward: the sample grid's rows
    start with the source, and the held-out edit evaluation writes source | before | after."""
    from flowrl.trainer import Trainer

    cfg = load_config(None, [
        "model.family=flux-kontext", "model.resolution=32", "model.tiny.resolution=32", "log.progress=false",
        "data.prompt_set=shapes-edit-train", "sampler.num_steps=3", "sampler.eval_num_steps=3",
        "train.prompts_per_iter=2", "algorithm.group_size=2", "train.iterations=2", f"log.output_dir={tmp_path}",
        "log.run_name=e", "log.sample_every=2", "log.eval=shapes-edit", "log.eval_seeds=[0]", "log.eval_every=0",
        "guard.enabled=false",
        "rewards=[{name: edit_gate, args: {instruction: {name: shapes_edit}, threshold: 0.5}}]"])
    run = Trainer(cfg).train()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(np.isfinite(r["reward_mean/total"]) for r in rows)
    assert rows[0]["ratio_max_abs_dev_first_update"] < 1e-5
    grid = Image.open(run / "samples" / "iter_00002.png")
    assert grid.size[0] > 0
    result = json.loads((run / "eval.json").read_text())
    assert result["before"]["images"] == 72 and set(result["after"]) >= {"edit", "asked", "kept", "per_attribute"}
    assert (run / "before_after.png").is_file()


@pytest.mark.parametrize("family, text_encodes", [("flux-kontext", 1), ("qwenimage-edit", 2)])
def test_an_instruction_over_two_sources(family, text_encodes, monkeypatch):
    """Two sources of one instruction are two rows with their own source latents. FLUX.1 Kontext encodes the
    instruction's text once; Qwen-Image-Edit's text encoder reads each source, so it encodes twice."""
    from flowrl.models import load_adapter

    adapter = load_adapter(load_config(None, [f"model.family={family}", "model.resolution=32",
                                              "model.tiny.resolution=32"]).model)
    calls = []
    inner = adapter._encode_one
    monkeypatch.setattr(adapter, "_encode_one", lambda p: calls.append(p) or inner(p))
    a = EditPrompt("make the shape red", ["shapes:a green circle on a blue background#3"])
    b = EditPrompt("make the shape red", ["shapes:a white square on a black background#4"])
    batch = adapter.encode_prompts([a, b, a])
    assert len(calls) == text_encodes
    assert torch.equal(batch.reference[0], batch.reference[2]) and not torch.equal(batch.reference[0], batch.reference[1])
    assert torch.equal(batch.embeds[0], batch.embeds[1]) == (text_encodes == 1)
