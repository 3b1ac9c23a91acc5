"""Reward models with the official checkpoint layouts, built tiny and offline: strict loading, preprocessing
parity with the documented pipelines, score formulas against hand computation."""

import math

import pytest
import torch
from flowrl.rewards import build_reward

from flowrl.errors import RewardError

TINY_OPEN_CLIP = {  # an open_clip CLIP at toy size (the ViT-H-14 key layout at width 32)
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 8, "head_width": 16},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


def fixed_images(n=3, h=40, w=56):
    g = torch.Generator().manual_seed(0)
    return torch.rand(n, 3, h, w, generator=g)


@pytest.fixture(scope="module")
def hf_clip_dir(tmp_path_factory):
    """A tiny transformers CLIPModel saved in the Hugging Face layout, logit_scale = ln 100 as real checkpoints."""
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(0)
    cfg = CLIPConfig(text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                      max_position_embeddings=77, vocab_size=49408),
                     vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, image_size=32, patch_size=8),
                     projection_dim=16)
    model = CLIPModel(cfg).eval()
    with torch.no_grad():
        model.logit_scale.fill_(math.log(100.0))
    path = tmp_path_factory.mktemp("hf_clip")
    model.save_pretrained(path)
    return path


# --------------------------------------------------------------------------------------------- preprocessing
def test_pil_path_equals_open_clip_val_transform():
    import open_clip
    from flowrl.rewards.backbones import clip_pixels
    from flowrl.rewards.loading import to_pil

    images = fixed_images()
    ours = clip_pixels(images, 32, "pil")
    ref_tf = open_clip.image_transform(32, is_train=False)  # Resize(shortest, bicubic) on PIL, crop, normalise
    ref = torch.stack([ref_tf(p) for p in to_pil(images)])
    assert ours.shape == (3, 3, 32, 32)
    assert (ours - ref).abs().max() < 1e-5


def test_tensor_bilinear_path_is_flow_grpos_pipeline():
    import torchvision.transforms as T
    from flowrl.rewards.backbones import OPENAI_MEAN, OPENAI_STD, clip_pixels

    images = fixed_images()
    ref = T.Compose([T.Resize(32, interpolation=T.InterpolationMode.BILINEAR, antialias=True), T.CenterCrop(32),
                     T.Normalize(OPENAI_MEAN, OPENAI_STD)])(images)
    assert torch.allclose(clip_pixels(images, 32, "tensor_bilinear"), ref, atol=1e-6)


def test_letterbox_pads_black_around_the_resized_image():
    from flowrl.rewards.backbones import OPENAI_MEAN, OPENAI_STD, clip_pixels

    img = torch.full((1, 3, 30, 60), 0.5)  # wide: 60 -> 40, 30 -> 20, 20 rows of padding split 10 / 10
    out = clip_pixels(img, 40, "letterbox")[0]
    mean, std = torch.tensor(OPENAI_MEAN).view(3, 1, 1), torch.tensor(OPENAI_STD).view(3, 1, 1)
    pad, content = (0 - mean) / std, (0.5 - mean) / std
    assert out.shape == (3, 40, 40)
    assert torch.allclose(out[:, :10], pad.expand(3, 10, 40), atol=1e-6)
    assert torch.allclose(out[:, 30:], pad.expand(3, 10, 40), atol=1e-6)
    assert torch.allclose(out[:, 10:30], content.expand(3, 20, 40), atol=1e-4)  # a constant stays constant
    odd = clip_pixels(torch.full((1, 3, 40, 21), 0.5), 40, "letterbox")[0]  # 19 columns: 9 left, 10 right
    assert torch.allclose(odd[:, :, :9], pad.expand(3, 40, 9), atol=1e-6)
    assert torch.allclose(odd[:, :, 30:], pad.expand(3, 40, 10), atol=1e-6)
    assert torch.allclose(odd[:, :, 9:30], content.expand(3, 40, 21), atol=1e-4)


# --------------------------------------------------------------------------------------------- CLIP score
def test_clip_conventions_on_fixed_cosines():
    from flowrl.rewards.clip import scale_cosine

    cos = torch.tensor([-0.2, 0.3])
    assert torch.allclose(scale_cosine(cos, "cosine", 100.0), cos)
    assert torch.allclose(scale_cosine(cos, "clipscore", 100.0), torch.tensor([0.0, 30.0]))
    assert torch.allclose(scale_cosine(cos, "hessel", 100.0), torch.tensor([0.0, 0.75]))
    assert torch.allclose(scale_cosine(cos, "flow_grpo", 100.0), torch.tensor([-0.2 * 100 / 30, 1.0]))


def test_clip_transformers_backend_flow_grpo_convention(hf_clip_dir):
    from flowrl.rewards.backbones import clip_pixels
    from transformers import CLIPModel

    from flowrl.tokenizer import build_clip_tokenizer

    images, prompts = fixed_images(2), ["a red circle", "a photo, of a dog!"]
    reward = build_reward("clip", model=str(hf_clip_dir), backend="transformers", convention="flow_grpo")
    model = CLIPModel.from_pretrained(hf_clip_dir).eval()
    tok = build_clip_tokenizer(77)(prompts, padding="max_length", max_length=77, truncation=True, return_tensors="pt")
    with torch.no_grad():  # Flow-GRPO: logits_per_image.diagonal() / 30 on the bilinear tensor path
        ref = model(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"],
                    pixel_values=clip_pixels(images, 32, "tensor_bilinear")).logits_per_image.diagonal() / 30
    assert torch.allclose(reward(images, prompts), ref, atol=1e-5)


def test_clip_rejects_unknown_convention():
    with pytest.raises(RewardError, match="convention"):
        build_reward("clip", convention="percent")


# --------------------------------------------------------------------------------------------- aesthetic
def _collapsed_affine(head):
    """The linear-only head as one affine map, in float64 (spec: 'linearMSE' has no activations)."""
    w, b = None, None
    for layer in head.layers:
        if isinstance(layer, torch.nn.Linear):
            lw, lb = layer.weight.double(), layer.bias.double()
            w, b = (lw, lb) if w is None else (lw @ w, lw @ b + lb)
    return w, b


def test_aesthetic_official_layout_and_score(hf_clip_dir, tmp_path):
    from flowrl.rewards.aesthetic import AestheticHead
    from flowrl.rewards.backbones import clip_pixels
    from transformers import CLIPModel

    torch.manual_seed(1)
    head = AestheticHead(16)
    state = head.state_dict()
    assert list(state) == [f"layers.{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("weight", "bias")]
    path = tmp_path / "sac+logos+ava1-l14-linearMSE.pth"
    torch.save(state, path)  # the official file is a bare fp32 state dict
    reward = build_reward("aesthetic", head=str(path), clip=str(hf_clip_dir))
    images = fixed_images(3)
    with torch.no_grad():
        emb = CLIPModel.from_pretrained(hf_clip_dir).get_image_features(pixel_values=clip_pixels(images, 32, "pil"))
        emb = getattr(emb, "pooler_output", emb)
    e = torch.nn.functional.normalize(emb.double(), dim=-1)
    w, b = _collapsed_affine(head)
    assert torch.allclose(reward(images).double(), (e @ w.T + b).squeeze(-1), atol=1e-5)


def test_aesthetic_wrong_layout_names_missing_keys(hf_clip_dir, tmp_path):
    relu_layout = {f"layers.{i}.{p}": torch.zeros(1) for i in (0, 3, 6, 9, 11) for p in ("weight", "bias")}
    path = tmp_path / "ava+logos-l14-reluMSE.pth"
    torch.save(relu_layout, path)
    with pytest.raises(RewardError, match=r"missing keys \(first: layers.2.weight"):
        build_reward("aesthetic", head=str(path), clip=str(hf_clip_dir))
    with pytest.raises(RewardError, match="head=/path/to/sac"):
        build_reward("aesthetic", clip=str(hf_clip_dir))


# --------------------------------------------------------------------------------------------- HPSv2
def _hps_checkpoint(tmp_path, wrap=True, dtype=torch.float16):
    from flowrl.rewards.clip import build_open_clip

    torch.manual_seed(2)
    model = build_open_clip(TINY_OPEN_CLIP)
    state = {k: v.to(dtype) for k, v in model.state_dict().items()}
    path = tmp_path / "HPS_v2.1_compressed.pt"
    torch.save({"state_dict": state} if wrap else state, path)
    return path, state


@pytest.mark.parametrize("wrap", [True, False])
def test_hpsv2_loads_official_format_and_scores_cosine(tmp_path, wrap):
    import open_clip
    from flowrl.rewards.backbones import OPENAI_MEAN, OPENAI_STD
    from flowrl.rewards.clip import build_open_clip

    path, state = _hps_checkpoint(tmp_path, wrap)
    reward = build_reward("hpsv2", checkpoint=str(path), model=TINY_OPEN_CLIP)
    ref = build_open_clip(TINY_OPEN_CLIP)
    ref.load_state_dict({k: v.float() for k, v in state.items()})
    images, prompts = fixed_images(2, 30, 60), ["a cat", "a don’t “quote” me"]
    # hand pipeline: letterbox 60x30 -> 32x16 (+8 black rows each side), OpenAI normalise; open_clip tokenizer
    import torchvision.transforms.functional as TF

    x = (images * 255).round().clamp(0, 255) / 255  # the references' uint8 PIL -> ToTensor
    x = TF.resize(x, [16, 32], interpolation=TF.InterpolationMode.BICUBIC, antialias=True)
    x = torch.nn.functional.pad(x, (0, 0, 8, 8))
    x = TF.normalize(x, OPENAI_MEAN, OPENAI_STD)
    with torch.no_grad():
        img = ref.encode_image(x, normalize=True)
        txt = ref.encode_text(open_clip.tokenize(prompts), normalize=True)
    assert torch.allclose(reward(images, prompts), (img * txt).sum(-1), atol=1e-5)


def test_hpsv2_wrong_keys_and_missing_file(tmp_path, monkeypatch):
    path, state = _hps_checkpoint(tmp_path)
    state = {("visual.proj_renamed" if k == "visual.proj" else k): v for k, v in state.items() if k != "logit_scale"}
    torch.save({"state_dict": state}, path)
    with pytest.raises(RewardError, match=r"2 missing keys \(first: logit_scale, visual.proj\).*unexpected.*visual.proj_renamed"):
        build_reward("hpsv2", checkpoint=str(path), model=TINY_OPEN_CLIP)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    with pytest.raises(RewardError, match="needs HPS_v2.1_compressed.pt from the Hugging Face repository xswu/HPSv2"):
        build_reward("hpsv2", model=TINY_OPEN_CLIP)
    bad = tmp_path / "garbage.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(RewardError, match="unreadable checkpoint"):
        build_reward("hpsv2", checkpoint=str(bad), model=TINY_OPEN_CLIP)


# --------------------------------------------------------------------------------------------- PickScore
def test_pickscore_scales_match_the_official_formula(hf_clip_dir):
    from flowrl.rewards.backbones import clip_pixels
    from transformers import CLIPModel

    from flowrl.tokenizer import build_clip_tokenizer

    images, prompts = fixed_images(2), ["a red circle on a blue background", "a dog"]
    model = CLIPModel.from_pretrained(hf_clip_dir).eval()
    tok = build_clip_tokenizer(77)(prompts, padding=True, truncation=True, max_length=77, return_tensors="pt")
    with torch.no_grad():  # PickScore README: logit_scale.exp() * cos of the projected embeddings
        official = model(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"],
                         pixel_values=clip_pixels(images, 32, "pil")).logits_per_image.diagonal()
    scores = {s: build_reward("pickscore", model=str(hf_clip_dir), processor=None, scale=s)(images, prompts)
              for s in ("official", "flow_grpo", "cosine")}
    assert torch.allclose(scores["official"], official, atol=1e-4)
    assert torch.allclose(scores["flow_grpo"], official / 26, atol=1e-5)
    assert torch.allclose(scores["cosine"], official / 100, atol=1e-6)
    # the default laion processor id is not available offline: the same processor is built locally instead
    assert torch.allclose(build_reward("pickscore", model=str(hf_clip_dir))(images, prompts), official, atol=1e-4)


def test_pickscore_missing_model_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(RewardError, match="needs the Hugging Face repository yuvalkirstain/PickScore_v1"):
        build_reward("pickscore")


def test_imagereward_names_the_package_when_missing():
    pytest.importorskip("torch")
    try:
        import ImageReward
        pytest.skip("image-reward is installed here")
    except ImportError:
        pass
    with pytest.raises(RewardError, match="pip install image-reward"):
        build_reward("imagereward")


# --------------------------------------------------------------------------------------------- video
def test_video_frame_aggregation():
    # frame k of video v has brightness (v + 1) * 0.1 + 0.01 k; the helper reward is the mean brightness
    videos = torch.stack([torch.stack([torch.full((3, 8, 8), (v + 1) * 0.1 + 0.01 * k) for k in range(6)])
                          for v in range(2)])  # (2, 6, 3, 8, 8)
    prompts = ["a", "b"]
    mean = build_reward("video_frames", reward="tests.helpers:brightness", frames="all")(videos, prompts)
    first = build_reward("video_frames", reward="tests.helpers:brightness", frames="first")(videos, prompts)
    every4 = build_reward("video_frames", reward="tests.helpers:brightness", frames="stride", stride=4)(videos, prompts)
    assert torch.allclose(mean, torch.tensor([0.1 + 0.025, 0.2 + 0.025]))
    assert torch.allclose(first, torch.tensor([0.1, 0.2]))
    assert torch.allclose(every4, torch.tensor([0.1 + 0.02, 0.2 + 0.02]))  # frames 0 and 4
    nan = build_reward("video_frames", reward="tests.helpers:half_nan", frames="stride", stride=1)(videos, prompts)
    assert torch.allclose(nan, torch.ones(2))  # NaN frames are left out of the mean
    with pytest.raises(RewardError, match=r"\(N, F, 3, H, W\)"):
        build_reward("video_frames", reward="tests.helpers:brightness")(videos[0], prompts)


def test_temporal_consistency_with_the_tiny_clip():
    g = torch.Generator().manual_seed(0)
    still = torch.rand(1, 3, 32, 32, generator=g).expand(4, 3, 32, 32)[None]  # 4 identical frames
    noisy = torch.rand(1, 4, 3, 32, 32, generator=g)
    reward = build_reward("temporal_consistency")
    scores = reward(torch.cat([still, noisy]), ["x", "y"])
    assert abs(float(scores[0]) - 1.0) < 1e-5
    assert float(scores[1]) < float(scores[0])


def test_open_clip_openai_tag_needs_the_quickgelu_model():
    with pytest.raises(RewardError, match="QuickGELU; use model='ViT-L-14-quickgelu'"):
        build_reward("clip", model="ViT-L-14", pretrained="openai")


def test_hf_checkpoint_with_missing_weights_is_refused(hf_clip_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(hf_clip_dir, broken)
    state = load_file(str(broken / "model.safetensors"))
    del state["visual_projection.weight"]
    save_file(state, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(RewardError, match="missing .*visual_projection.weight"):
        build_reward("pickscore", model=str(broken), processor=None)
