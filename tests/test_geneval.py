"""GenEval's rules on hand-made detections, one case per task type, and the position rule worked by hand."""

from __future__ import annotations

import math

import pytest

from flowrl.rewards.geneval import Detection, check, keep_detections, relative_position


def det(label, x0, y0, x1, y1, score=0.95):
    return Detection((x0, y0, x1, y1), score, label)


def test_relative_position_by_hand():
    # A centred at (10, 50), B at (90, 50), both 20 x 20: offset (-80, 0), shrunk by 0.1 * 40 = 4 -> (-76, 0);
    # / |offset| 80 -> dx = -0.95 < -0.5
    assert relative_position((0, 40, 20, 60), (80, 40, 100, 60)) == {"left of"}
    assert relative_position((80, 40, 100, 60), (0, 40, 20, 60)) == {"right of"}
    # A above B (y grows downwards); diagonal offset (30, -30): shrunk (26, -26) / 42.4 = (0.61, -0.61): both
    assert relative_position((30, 0, 50, 20), (0, 30, 20, 50)) == {"right of", "above"}
    # nearly overlapping: offset (2, 0) shrinks to 0 -> no relation
    assert relative_position((0, 0, 20, 20), (2, 0, 22, 20)) == set()
    # offset (30, 20) of 20-px boxes: shrunk (26, 16) / 36.1 = (0.72, 0.44): right of only
    assert relative_position((30, 20, 50, 40), (0, 0, 20, 20)) == {"right of"}


def test_thresholds_order_and_limit():
    dets = [det("dog", 0, 0, 1, 1, 0.5), det("dog", 0, 0, 1, 1, 0.95), det("dog", 0, 0, 1, 1, 0.2)]
    kept = keep_detections(dets, "two_object")
    assert [d.score for d in kept["dog"]] == [0.95, 0.5]  # above 0.3, most confident first
    assert [d.score for d in keep_detections(dets, "counting")["dog"]] == [0.95]  # counting: above 0.9
    many = [det("cup", 0, 0, 1, 1, 0.9 - i / 100) for i in range(20)]
    assert len(keep_detections(many, "single_object")["cup"]) == 16


CASES = [
    # (task, metadata, detections, colours by class, correct, partial)
    ("single_object", {"include": [{"class": "bench", "count": 1}]}, [det("bench", 0, 0, 9, 9)], {}, True, 1.0),
    ("single_object", {"include": [{"class": "bench", "count": 1}]}, [det("dog", 0, 0, 9, 9)], {}, False, 0.0),
    ("two_object", {"include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1}]},
     [det("dog", 0, 0, 9, 9), det("cat", 20, 0, 29, 9)], {}, True, 1.0),
    ("two_object", {"include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1}]},
     [det("dog", 0, 0, 9, 9)], {}, False, 0.5),
    ("counting", {"include": [{"class": "apple", "count": 3}], "exclude": [{"class": "apple", "count": 4}]},
     [det("apple", i * 10, 0, i * 10 + 9, 9) for i in range(3)], {}, True, 1.0),
    ("counting", {"include": [{"class": "apple", "count": 3}], "exclude": [{"class": "apple", "count": 4}]},
     [det("apple", i * 10, 0, i * 10 + 9, 9) for i in range(4)], {}, False, 0.5),  # four: the exclude fails
    ("colors", {"include": [{"class": "car", "count": 1, "color": "red"}]}, [det("car", 0, 0, 9, 9)],
     {"car": ["red"]}, True, 1.0),
    ("colors", {"include": [{"class": "car", "count": 1, "color": "red"}]}, [det("car", 0, 0, 9, 9)],
     {"car": ["blue"]}, False, 0.0),
    ("position", {"include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1, "position": ["left of", 0]}]},
     [det("cat", 80, 40, 100, 60), det("dog", 0, 40, 20, 60)], {}, True, 1.0),
    ("position", {"include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1, "position": ["left of", 0]}]},
     [det("cat", 0, 40, 20, 60), det("dog", 80, 40, 100, 60)], {}, False, 0.5),
    ("position", {"include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1, "position": ["left of", 0]}]},
     [det("dog", 0, 40, 20, 60)], {}, False, 0.0),  # no cat: no target for the dog either
    ("color_attr", {"include": [{"class": "cup", "count": 1, "color": "green"},
                                {"class": "vase", "count": 1, "color": "purple"}]},
     [det("cup", 0, 0, 9, 9), det("vase", 20, 0, 29, 9)], {"cup": ["green"], "vase": ["purple"]}, True, 1.0),
    ("color_attr", {"include": [{"class": "cup", "count": 1, "color": "green"},
                                {"class": "vase", "count": 1, "color": "purple"}]},
     [det("cup", 0, 0, 9, 9), det("vase", 20, 0, 29, 9)], {"cup": ["purple"], "vase": ["green"]}, False, 0.0),
]


@pytest.mark.parametrize("task, metadata, dets, colours, correct, partial", CASES,
                         ids=[f"{c[0]}-{'ok' if c[4] else 'fails'}-{i}" for i, c in enumerate(CASES)])
def test_every_task_type_by_hand(task, metadata, dets, colours, correct, partial):
    objects = keep_detections(dets, task)
    ok, reasons, part = check(objects, metadata, lambda name, found: colours[name][:len(found)])
    assert ok == correct and bool(reasons) == (not correct)
    assert part == pytest.approx(partial)


def test_only_the_most_confident_count_are_checked_for_colour():
    dets = [det("car", 0, 0, 9, 9, 0.99), det("car", 20, 0, 29, 9, 0.5)]
    seen = []

    def colours(name, found):
        seen.append([d.score for d in found])
        return ["red"]

    ok, _, _ = check(keep_detections(dets, "colors"), {"include": [{"class": "car", "count": 1, "color": "red"}]},
                     colours)
    assert ok and seen == [[0.99]]
    assert math.isnan(check({}, {})[2])
    # a dataset fills a column a row lacks with None (GenEval's rows without exclude clauses)
    assert check({"car": dets[:1]}, {"include": [{"class": "car", "count": 1}], "exclude": None})[0]


@pytest.fixture(scope="module")
def tiny_owlv2(tmp_path_factory):
    """A randomly initialised OWLv2 of the real architecture at tiny size, saved as a local folder."""
    import torch
    from transformers import Owlv2Config, Owlv2ForObjectDetection, Owlv2ImageProcessor, Owlv2Processor

    from flowrl.tokenizer import build_clip_tokenizer

    folder = tmp_path_factory.mktemp("owlv2")
    cfg = Owlv2Config(text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                       vocab_size=49408, max_position_embeddings=16),
                      vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, image_size=64, patch_size=16), projection_dim=32)
    torch.manual_seed(0)
    Owlv2ForObjectDetection(cfg).save_pretrained(folder)
    Owlv2Processor(image_processor=Owlv2ImageProcessor(size={"height": 64, "width": 64}),
                   tokenizer=build_clip_tokenizer(16)).save_pretrained(folder)
    return folder


def test_the_detector_backed_reward_runs_end_to_end(tiny_owlv2):
    import torch

    from flowrl.rewards import build_reward

    reward = build_reward("geneval", detector=str(tiny_owlv2), threshold=0.0)
    images = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    metadata = [{"tag": "single_object", "include": [{"class": "dog", "count": 1}]},
                {"tag": "single_object", "include": [{"class": "dog", "count": 17}]},  # more than 16 boxes exist
                {"tag": "colors", "include": [{"class": "dog", "count": 1, "color": "red"}]},
                {}]
    scores = reward(images, ["a dog"] * 4, metadata)
    # the tiny detector has 16 boxes, all of the one queried class, kept at threshold 0: one dog is there,
    # seventeen are not; the colour verdict is the tiny CLIP's, 0 or 1; no clauses: not scored
    assert scores[:2].tolist() == [1.0, 0.0] and scores[2].item() in (0.0, 1.0) and math.isnan(scores[3].item())
    boxes = reward.detect(images[0], ["dog", "cat"])
    assert len(boxes) == 16 and {d.label for d in boxes} <= {"dog", "cat"}
    partial = build_reward("geneval", detector=str(tiny_owlv2), threshold=0.0, score="partial")
    two = {"tag": "two_object", "include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 17}]}
    assert partial(images[:1], ["a dog and a cat"], [two]).item() == pytest.approx(0.5)
