"""HPSv3 loads from a local folder of a tiny Qwen2-VL of the real architecture (its checkpoint in the released key
layout) and scores: the mean output of the reward head at the reward token, computed again by hand here."""

from __future__ import annotations

import pytest
import torch


def build_tiny_hpsv3(folder):
    """A tiny Qwen2-VL base folder (config and processor, built offline) and HPSv3.safetensors in the layout the
    released checkpoint uses (``model.layers`` / ``visual`` / ``lm_head`` / ``rm_head``)."""
    from safetensors.torch import save_file
    from transformers import Qwen2VLConfig, Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    from flowrl.models.tiny import build_tiny_byte_level_tokenizer
    from flowrl.rewards.qwen_vl import QwenVLRewardModel

    tok = build_tiny_byte_level_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                                         "<|video_pad|>"]})
    Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 4096),
                     tokenizer=tok, video_processor=Qwen2VLVideoProcessor()).save_pretrained(folder)
    ids = tok.convert_tokens_to_ids
    cfg = Qwen2VLConfig(
        text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=len(tok) + 8, max_position_embeddings=4096,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, pad_token_id=tok.pad_token_id,
                         bos_token_id=None, eos_token_id=None),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"))
    cfg.save_pretrained(folder)
    torch.manual_seed(0)
    model = QwenVLRewardModel(cfg)
    released = {}
    for key, value in model.state_dict().items():  # back to the released names
        key = key.replace("backbone.language_model.", "model.").replace("backbone.visual.", "visual.")
        released[key] = value.contiguous()
    released["lm_head.weight"] = torch.zeros(len(tok) + 8, 32)
    save_file(released, str(folder / "HPSv3.safetensors"))
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hpsv3")
    return folder, build_tiny_hpsv3(folder)


def test_hpsv3_loads_a_local_tiny_model_and_scores_the_reward_token(tiny):
    from flowrl.rewards import build_reward
    from flowrl.rewards.hpsv3 import REWARD_TOKEN
    from flowrl.rewards.qwen_vl import resized_side

    folder, model = tiny
    reward = build_reward("hpsv3", checkpoint=str(folder), base=str(folder), dtype="fp32")
    images = torch.rand(3, 3, 64, 48, generator=torch.Generator().manual_seed(1))
    prompts = ["a cat", "a dog on a sofa", "a cat"]
    scores = reward(images, prompts, [{}] * 3)
    assert scores.shape == (3,) and torch.isfinite(scores).all() and scores[0] != scores[1]
    # by hand: the same inputs through the tiny model we saved, the head's first output at the reward token
    from PIL import Image

    from flowrl.rewards.loading import to_pil

    pil = [p.resize(resized_side(p.height, p.width)[::-1], Image.BICUBIC) for p in to_pil(images)]
    batch = reward.processor(text=[reward.text(p) for p in prompts], images=pil, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model.eval().backbone(**dict(batch)).last_hidden_state
        rid = reward.processor.tokenizer.convert_tokens_to_ids(REWARD_TOKEN)
        expect = torch.stack([model.rm_head(hidden[i, batch["input_ids"][i] == rid].float())[0, 0] for i in range(3)])
    assert scores.tolist() == pytest.approx(expect.tolist(), abs=1e-5)


def test_the_resize_rule_by_hand():
    from flowrl.rewards.qwen_vl import resized_side

    assert resized_side(448, 448) == (448, 448)  # 16 x 16 patches of 28: exactly 256 * 28 * 28 pixels
    assert resized_side(1024, 1024) == (448, 448)  # scaled down, floored to multiples of 28
    assert resized_side(64, 64) == (448, 448)  # scaled up, ceiled
    h, w = resized_side(512, 768)
    assert h % 28 == 0 and w % 28 == 0 and h * w <= 256 * 28 * 28 and w > h


def test_a_checkpoint_of_another_layout_is_refused_in_one_line(tiny, tmp_path):
    from safetensors.torch import save_file

    from flowrl.errors import RewardError
    from flowrl.rewards import build_reward

    folder, _ = tiny
    save_file({"rm_head.0.weight": torch.zeros(1024, 32)}, str(tmp_path / "HPSv3.safetensors"))
    with pytest.raises(RewardError, match="does not match the QwenVLRewardModel layout: .* missing keys"):
        build_reward("hpsv3", checkpoint=str(tmp_path), base=str(folder), dtype="fp32")
