"""VideoReward (VideoAlign) loads from a local folder of a tiny Qwen2-VL of the real architecture, its checkpoint in
the released layout with the vocabulary resized for its three reward tokens, and scores clips: the linear head at
each reward token, normalised with the release's statistics and summed, computed again by hand here."""

from __future__ import annotations

import pytest
import torch

from tests.test_hpsv3 import build_tiny_hpsv3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    from flowrl.rewards.qwen_vl import QwenVLRewardModel

    folder = tmp_path_factory.mktemp("videoreward")
    build_tiny_hpsv3(folder)  # the same tiny Qwen2-VL base folder
    from transformers import AutoConfig

    torch.manual_seed(1)
    model = QwenVLRewardModel(AutoConfig.from_pretrained(folder), head="linear", outputs=1)
    rows = len(load_file(str(folder / "HPSv3.safetensors"))["lm_head.weight"]) - 5  # resized like the release's
    model.backbone.language_model.embed_tokens = torch.nn.Embedding(rows, 32)
    released = {k.replace("backbone.language_model.", "model.").replace("backbone.visual.", "visual."): v.contiguous()
                for k, v in model.state_dict().items()}
    save_file(released, str(folder / "model.safetensors"))
    return folder, model


def test_frame_sampling_at_two_per_second():
    from flowrl.rewards.videoalign import sample_frames

    assert sample_frames(33, 16.0) == [0, 11, 21, 32]  # 2.06 s at 16 fps -> 4 frames over 0..32 (32 / 3 apart)
    assert sample_frames(81, 16.0) == torch.linspace(0, 80, 10).round().long().tolist()  # 5.06 s -> 10 frames
    assert sample_frames(5, 16.0) == [0, 1, 3, 4]  # at least 4
    assert len(sample_frames(3, 16.0)) == 2  # never more than there are (an even count)


def test_videoalign_scores_a_tiny_model_by_hand(tiny):
    from flowrl.rewards import build_reward
    from flowrl.rewards.videoalign import NORM, TOKENS

    folder, model = tiny
    reward = build_reward("videoalign", checkpoint=str(folder), base=str(folder), dtype="fp32", video_fps=4)
    videos = torch.rand(2, 8, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    scores = reward.scores(videos, ["a cat walking", "a red car"])
    assert set(scores) == {"VQ", "MQ", "TA", "Overall"} and torch.isfinite(scores["Overall"]).all()
    assert scores["Overall"] == pytest.approx(scores["VQ"] + scores["MQ"] + scores["TA"])
    assert reward(videos, ["a cat walking", "a red car"]).tolist() == pytest.approx(scores["Overall"].tolist())
    # by hand for the first clip: the head at each token, (raw - mean) / std
    batch = reward.processor(text=[reward.text("a cat walking")], videos=[reward.frames(videos[0])],
                             return_tensors="pt", do_resize=False, do_sample_frames=False)
    with torch.no_grad():
        hidden = model.eval().backbone(**dict(batch)).last_hidden_state[0]
    ids = batch["input_ids"][0]
    tok = reward.processor.tokenizer
    for name, token in zip(NORM, TOKENS):
        raw = model.rm_head(hidden[ids == tok.convert_tokens_to_ids(token)].float())[0, 0].item()
        assert scores[name][0].item() == pytest.approx((raw - NORM[name][0]) / NORM[name][1], abs=1e-5)
    with pytest.raises(Exception, match="videoalign scores videos"):
        reward(videos[:, 0], ["a"] * 2)
