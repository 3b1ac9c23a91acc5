"""EditReward loads from a local folder of a tiny Qwen2.5-VL of the real architecture (its two-head checkpoint in the
released key layout, with the ``<|Reward|>`` token added to the vocabulary) and scores an edit: the mean over the two
heads of each head's mean output at the reward token, each head reading its own pass over source and result,
computed again by hand here."""

from __future__ import annotations

import pytest
import torch

from flowrl.editing import EditPrompt


def build_tiny_editreward(folder):
    """A tiny Qwen2.5-VL base folder (config and processor, built offline, without the reward token) and
    ``model.pth`` as the released trainer saves it: ``{'model': state}`` with ``model.*`` / ``visual.*`` /
    ``lm_head`` / ``rm_heads.head_<i>`` names and the embeddings resized for the added token."""
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor)

    from flowrl.models.tiny import build_tiny_byte_level_tokenizer
    from flowrl.rewards.qwen_vl import QwenVLRewardModel

    tok = build_tiny_byte_level_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                                         "<|video_pad|>"]})
    Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 4096),
                        tokenizer=tok, video_processor=Qwen2VLVideoProcessor()).save_pretrained(folder)
    ids = tok.convert_tokens_to_ids
    vocab = len(tok) + 8
    cfg = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=vocab, max_position_embeddings=4096,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, pad_token_id=tok.pad_token_id,
                         bos_token_id=None, eos_token_id=None),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[0]),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"))
    cfg.save_pretrained(folder)
    torch.manual_seed(0)
    model = QwenVLRewardModel(cfg, heads=2)
    with torch.no_grad():  # the released vocabulary has one more row: the reward token's
        model.backbone.language_model.embed_tokens = torch.nn.Embedding(vocab + 1, 32)
    released = {}
    for key, value in model.state_dict().items():  # back to the released names
        key = key.replace("backbone.language_model.", "model.").replace("backbone.visual.", "visual.")
        released[key] = value.contiguous()
    released["lm_head.weight"] = torch.zeros(vocab + 1, 32)
    torch.save({"model": released}, folder / "model.pth")
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("editreward")
    return folder, build_tiny_editreward(folder)


def test_editreward_scores_source_and_result_with_two_heads(tiny):
    from flowrl.editing import source_tensor
    from flowrl.rewards import build_reward
    from flowrl.rewards.editreward import REWARD_TOKEN, EditReward

    folder, model = tiny
    reward = build_reward("editreward", checkpoint=str(folder), base=str(folder), dtype="fp32")
    requests = [EditPrompt("make the shape red", ["shapes:a green circle on a blue background#3"]),
                EditPrompt("make the background white", ["shapes:a green circle on a blue background#3"]),
                EditPrompt("make the shape red", ["shapes:a white square on a black background#4"])]
    images = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    scores = reward(images, requests, [{}] * 3)
    assert scores.shape == (3,) and torch.isfinite(scores).all() and len(set(scores.tolist())) == 3
    # by hand: per head, its pass over [source, result] through the saved model, the head's mean at the token
    pils = [p for pair in zip(EditReward.resized(source_tensor(requests, 32)), EditReward.resized(images)) for p in pair]
    assert pils[0].size == (448, 448)
    rid = reward.processor.tokenizer.convert_tokens_to_ids(REWARD_TOKEN)
    heads = []
    with torch.no_grad():
        for head in (0, 1):
            batch = reward.processor(text=[EditReward.text(str(r), head) for r in requests], images=pils,
                                     padding=True, return_tensors="pt")
            assert (batch["input_ids"] == rid).sum(1).tolist() == [1, 1, 1]
            hidden = model.eval().backbone(**dict(batch)).last_hidden_state
            heads.append(torch.stack([model.rm_heads[f"head_{head}"](hidden[i, batch["input_ids"][i] == rid])[0, 0]
                                      for i in range(3)]))
    assert not torch.allclose(heads[0], heads[1])  # two heads, two passes
    assert scores.tolist() == pytest.approx(((heads[0] + heads[1]) / 2).tolist(), abs=1e-5)
    # the edit's source counts: another source under the same instruction and result scores otherwise
    moved = [EditPrompt("make the shape red", ["shapes:a purple cross on a yellow background#9"])]
    assert reward(images[:1], moved, [{}])[0] != pytest.approx(scores[0].item(), abs=1e-6)


def test_editreward_needs_edit_requests(tiny):
    from flowrl.errors import ConfigError
    from flowrl.rewards import build_reward

    folder, _ = tiny
    reward = build_reward("editreward", checkpoint=str(folder), base=str(folder), dtype="fp32")
    with pytest.raises(ConfigError, match="has no source image"):
        reward(torch.rand(1, 3, 32, 32), ["a cat"], [{}])
