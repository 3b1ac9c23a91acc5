"""The tiny SD3-architecture models: built offline from a config (random init, for tests and the quick demo),
or a small SD3 model exported as a folder (the shipped pretrained models are registered by name)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import FlowRLError


def build_tiny_sd3_pipeline(tiny, seed: int = 0):
    """A tiny SD3-architecture pipeline from configs, offline and randomly initialised.

    ``tiny`` is a :class:`flowrl.config.TinyModelConfig`. Pixel space (``tiny.vae = False``) uses 3 image
    channels directly; otherwise a tiny AutoencoderKL with 4 latent channels and 2x downsampling is built.
    """
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    from ..tokenizer import build_clip_tokenizer

    torch.manual_seed(seed)
    latent_size = tiny.resolution // (2 if tiny.vae else 1)
    in_channels = 4 if tiny.vae else 3
    transformer = SD3Transformer2DModel(
        sample_size=latent_size,
        patch_size=tiny.patch_size,
        in_channels=in_channels,
        out_channels=in_channels,
        num_layers=tiny.num_layers,
        attention_head_dim=tiny.attention_head_dim,
        num_attention_heads=tiny.num_attention_heads,
        joint_attention_dim=2 * tiny.text_hidden,
        caption_projection_dim=tiny.attention_head_dim * tiny.num_attention_heads,
        pooled_projection_dim=2 * tiny.text_projection,
        pos_embed_max_size=max(latent_size // tiny.patch_size, 2),
        qk_norm="rms_norm",
    )
    text_cfg = dict(hidden_size=tiny.text_hidden, intermediate_size=4 * tiny.text_hidden, num_hidden_layers=tiny.text_layers,
                    num_attention_heads=max(tiny.text_hidden // 16, 1), projection_dim=tiny.text_projection,
                    max_position_embeddings=max(tiny.max_tokens, 16), vocab_size=49408,
                    bos_token_id=49406, eos_token_id=49407, pad_token_id=49407)
    text_encoder = CLIPTextModelWithProjection(CLIPTextConfig(**text_cfg))
    text_encoder_2 = CLIPTextModelWithProjection(CLIPTextConfig(**text_cfg))
    tokenizer = build_clip_tokenizer(tiny.max_tokens)
    tokenizer_2 = build_clip_tokenizer(tiny.max_tokens)
    vae = None
    if tiny.vae:
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=4,
            down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
            up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
            block_out_channels=(16, 32), layers_per_block=1, norm_num_groups=8, sample_size=tiny.resolution,
            shift_factor=0.0, scaling_factor=1.0,
        )
    scheduler = FlowMatchEulerDiscreteScheduler(shift=tiny.shift)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=scheduler, vae=vae,
        text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
        text_encoder_3=None, tokenizer_3=None,
    )
    if vae is None:
        pipe.vae_scale_factor = 1
    return pipe


def load_exported_tiny_sd3(path: str | Path):
    """A small SD3-architecture model exported as a folder (transformer, scheduler, two CLIP text encoders, no VAE,
    ``pretrain.json`` with its tokenizer length) as a StableDiffusion3Pipeline (fp32), tokenizers built offline."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection

    from ..tokenizer import build_clip_tokenizer

    path = Path(path)
    if not (path / "transformer" / "config.json").is_file():
        raise FlowRLError(f"{path}: no exported tiny model here (transformer/config.json is missing)")
    kw = {"torch_dtype": torch.float32}
    meta = json.loads((path / "pretrain.json").read_text()) if (path / "pretrain.json").is_file() else {}
    max_tokens = meta.get("config", {}).get("max_tokens", 16)
    pipe = StableDiffusion3Pipeline(
        transformer=SD3Transformer2DModel.from_pretrained(str(path / "transformer"), **kw),
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(str(path / "scheduler")),
        vae=None,
        text_encoder=CLIPTextModelWithProjection.from_pretrained(str(path / "text_encoder"), **kw),
        tokenizer=build_clip_tokenizer(max_tokens),
        text_encoder_2=CLIPTextModelWithProjection.from_pretrained(str(path / "text_encoder_2"), **kw),
        tokenizer_2=build_clip_tokenizer(max_tokens),
        text_encoder_3=None, tokenizer_3=None,
    )
    pipe.vae_scale_factor = 1
    pipe.embedded_geometry = {"resolution": pipe.transformer.config.sample_size}
    return pipe


def _rope_axes(head_dim: int) -> tuple[int, int, int]:
    """FLUX's rotary axes (text / row / column) summing to the head dim, each even: 128 -> (16, 56, 56)."""
    first = 2 * (head_dim // 8)
    second = 2 * ((head_dim - first) // 4)
    return first, second, head_dim - first - second


def build_tiny_flux_pipeline(tiny, seed: int = 0, pixel_space: bool = False):
    """A tiny FLUX.1-dev-architecture pipeline from configs, offline and randomly initialised: a 2x VAE with 4
    latent channels (16 after 2x2 packing), CLIP + T5 encoders (the T5 uses the offline CLIP tokenizer; a real
    checkpoint brings its own), the guidance embedding and FLUX's dynamic-shift scheduler.

    ``pixel_space``: no VAE (the transformer packs 2x2 pixel patches of 3 channels) and a fixed shift of
    ``tiny.shift``, as the shapes domain's pretrained models use."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from ..tokenizer import build_clip_tokenizer

    torch.manual_seed(seed)
    latent_channels = 3 if pixel_space else 4
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4 * latent_channels, num_layers=tiny.num_layers, num_single_layers=tiny.num_layers,
        attention_head_dim=tiny.attention_head_dim, num_attention_heads=tiny.num_attention_heads,
        joint_attention_dim=tiny.text_hidden, pooled_projection_dim=tiny.text_hidden, guidance_embeds=True,
        axes_dims_rope=_rope_axes(tiny.attention_head_dim),
    )
    clip = CLIPTextModel(CLIPTextConfig(
        hidden_size=tiny.text_hidden, intermediate_size=4 * tiny.text_hidden, num_hidden_layers=tiny.text_layers,
        num_attention_heads=max(tiny.text_hidden // 16, 1), max_position_embeddings=max(tiny.max_tokens, 16),
        vocab_size=49408, bos_token_id=49406, eos_token_id=49407, pad_token_id=49407))
    t5 = T5EncoderModel(T5Config(vocab_size=49408, d_model=tiny.text_hidden, d_kv=16, d_ff=4 * tiny.text_hidden,
                                 num_layers=tiny.text_layers, num_heads=max(tiny.text_hidden // 16, 1),
                                 pad_token_id=49407, eos_token_id=49407, decoder_start_token_id=49407))
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=latent_channels,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(16, 32), layers_per_block=1, norm_num_groups=8, sample_size=tiny.resolution,
        scaling_factor=0.3611, shift_factor=0.1159,  # FLUX.1's VAE constants
    )
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    if pixel_space:
        vae, scheduler = None, FlowMatchEulerDiscreteScheduler(shift=tiny.shift)
    return FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=clip, tokenizer=build_clip_tokenizer(tiny.max_tokens),
                        text_encoder_2=t5, tokenizer_2=build_clip_tokenizer(tiny.max_tokens), transformer=transformer)


def build_tiny_flux_kontext_pipeline(tiny, seed: int = 0, pixel_space: bool = False):
    """A tiny FLUX.1 Kontext pipeline: the tiny FLUX.1 components (:func:`build_tiny_flux_pipeline`, the same
    weights at the same seed) in ``FluxKontextPipeline``, which adds the source image's latents as tokens."""
    from diffusers import FluxKontextPipeline

    return FluxKontextPipeline(**build_tiny_flux_pipeline(tiny, seed, pixel_space).components)


def load_exported_tiny_flux_kontext(path: str | Path):
    """A pixel-space FLUX.1 Kontext-architecture model exported as a folder (transformer, scheduler, CLIP and T5 text
    encoders, no VAE, ``pretrain.json`` with its tokenizer length) as a FluxKontextPipeline (fp32), tokenizers built
    offline."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5EncoderModel

    from ..tokenizer import build_clip_tokenizer

    path = Path(path)
    if not (path / "transformer" / "config.json").is_file():
        raise FlowRLError(f"{path}: no exported tiny model here (transformer/config.json is missing)")
    kw = {"torch_dtype": torch.float32}
    meta = json.loads((path / "pretrain.json").read_text()) if (path / "pretrain.json").is_file() else {}
    config = meta.get("config", {})
    max_tokens = config.get("max_tokens", 16)
    pipe = FluxKontextPipeline(
        transformer=FluxTransformer2DModel.from_pretrained(str(path / "transformer"), **kw),
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(str(path / "scheduler")), vae=None,
        text_encoder=CLIPTextModel.from_pretrained(str(path / "text_encoder"), **kw),
        tokenizer=build_clip_tokenizer(max_tokens),
        text_encoder_2=T5EncoderModel.from_pretrained(str(path / "text_encoder_2"), **kw),
        tokenizer_2=build_clip_tokenizer(max_tokens))
    if "resolution" in config:
        pipe.embedded_geometry = {"resolution": config["resolution"]}
    pipe.embedded_max_tokens = max_tokens
    return pipe


QWEN_TEMPLATE_WORDS = ("Describe the image by detailing the color, shape, size, texture, quantity, text, spatial "
                       "relationships of the objects and background system user assistant")


def build_tiny_byte_level_tokenizer(vocab_size: int = 600):
    """A byte-level BPE tokenizer (the kind Qwen2 uses) trained offline on short object captions and Qwen-Image's
    prompt template, with the chat special tokens; deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    colors = ("red", "green", "blue", "yellow", "white", "black", "purple", "orange", "gray", "pink")
    nouns = ("circle", "square", "triangle", "cross", "cat", "dog", "photo", "painting", "horse", "astronaut")
    corpus = [QWEN_TEMPLATE_WORDS] + [f"a {c} {n} on a {b} background" for c in colors for n in nouns for b in colors[:3]]
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|endoftext|>")


def build_tiny_qwenimage_pipeline(tiny, seed: int = 0):
    """A tiny Qwen-Image-architecture pipeline from configs, offline and randomly initialised: a Qwen2.5-VL text
    encoder (a tiny vision tower included, as the class requires), the byte-level tokenizer above, a 2x
    Qwen-Image VAE with 4 latent channels, and the dynamic-shift scheduler."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    tokenizer = build_tiny_byte_level_tokenizer()
    h = tiny.text_hidden
    text_cfg = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=h, intermediate_size=2 * h, num_hidden_layers=tiny.text_layers, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=len(tokenizer), max_position_embeddings=4096,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
                         bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=h, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[0]))
    text_encoder = Qwen2_5_VLForConditionalGeneration(text_cfg)
    z = 4
    vae = AutoencoderKLQwenImage(base_dim=16, z_dim=z, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[False],
                                 latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.8, 1.2, 2.0])
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=4 * z, out_channels=z, num_layers=tiny.num_layers,
        attention_head_dim=tiny.attention_head_dim, num_attention_heads=tiny.num_attention_heads, joint_attention_dim=h,
        axes_dims_rope=_rope_axes(tiny.attention_head_dim))
    scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                                                base_image_seq_len=256, max_image_seq_len=8192)
    return QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                             transformer=transformer)


def build_tiny_qwenimage_edit_pipeline(tiny, seed: int = 0):
    """A tiny Qwen-Image-Edit pipeline: the tiny Qwen-Image architecture (:func:`build_tiny_qwenimage_pipeline`)
    whose byte-level tokenizer also has Qwen2.5-VL's vision tokens, so that its text encoder (with its tiny vision
    tower) reads the source image through a ``Qwen2VLProcessor`` as the real one does. The pipeline's template is
    kept; the count of its leading tokens dropped from the embedding is this tokenizer's. Returns (pipeline,
    {"source_side": tiny.resolution}): the tiny model reads sources at its own resolution, the real one at 1024 px."""
    from diffusers import QwenImageEditPipeline
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    base = build_tiny_qwenimage_pipeline(tiny, seed)
    torch.manual_seed(seed + 1)
    tokenizer = build_tiny_byte_level_tokenizer()
    vision = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": vision})
    tokenizer.image_token, tokenizer.video_token = "<|image_pad|>", "<|video_pad|>"
    ids = tokenizer.convert_tokens_to_ids(vision)
    config = base.text_encoder.config.to_dict()
    config["text_config"]["vocab_size"] = len(tokenizer)
    config.update(vision_start_token_id=ids[0], image_token_id=ids[1], vision_end_token_id=ids[2], video_token_id=ids[3])
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**{k: v for k, v in config.items()
                                                                           if k not in ("architectures",)}))
    processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=56 * 56),
                                 tokenizer=tokenizer, video_processor=Qwen2VLVideoProcessor())
    pipe = QwenImageEditPipeline(scheduler=base.scheduler, vae=base.vae, text_encoder=text_encoder,
                                 tokenizer=tokenizer, processor=processor, transformer=base.transformer)
    prefix = pipe.prompt_template_encode.split("<|vision_start|>")[0]  # the system turn and "user" before the image
    pipe.prompt_template_encode_start_idx = len(tokenizer(prefix).input_ids)
    return pipe, {"source_side": tiny.resolution}


def build_tiny_qwenimage_edit_plus_pipeline(tiny, seed: int = 0):
    """A tiny Qwen-Image-Edit-Plus pipeline: the tiny Qwen-Image-Edit components
    (:func:`build_tiny_qwenimage_edit_pipeline`, the same weights at the same seed) in ``QwenImageEditPlusPipeline``,
    whose template puts a "Picture i:" vision block per source before the instruction; the count of its leading
    tokens dropped from the embedding is this tokenizer's. Returns (pipeline, {"source_side": ..., "condition_side":
    ...}): the tiny model reads its sources at its own resolution for both encoders."""
    from diffusers import QwenImageEditPlusPipeline

    base, _ = build_tiny_qwenimage_edit_pipeline(tiny, seed)
    pipe = QwenImageEditPlusPipeline(**base.components)
    prefix = pipe.prompt_template_encode.split("{}")[0]  # the system turn and "user" before the pictures
    pipe.prompt_template_encode_start_idx = len(base.tokenizer(prefix).input_ids)
    return pipe, {"source_side": tiny.resolution, "condition_side": tiny.resolution}


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tiny_flux2_pipeline(tiny, seed: int = 0):
    """A tiny FLUX.2 [klein]-architecture pipeline (Qwen3 text encoder, the offline byte-level tokenizer with a
    chat template, a 2x FLUX.2 VAE with 4 latent channels and batch-norm statistics, no guidance embedding).
    Returns (pipeline, {"text_encoder_out_layers": the layers whose states form the prompt embedding})."""
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinPipeline,
        Flux2Transformer2DModel,
    )
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    tokenizer = build_tiny_byte_level_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    h = tiny.text_hidden
    text_encoder = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=h, intermediate_size=2 * h, num_hidden_layers=tiny.text_layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None))
    layers = tuple(range(1, tiny.text_layers + 1))  # every layer's states (the real model takes 9, 18, 27)
    z = 4
    vae = AutoencoderKLFlux2(block_out_channels=(16, 32), down_block_types=("DownEncoderBlock2D",) * 2,
                             up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=z, norm_num_groups=8,
                             layers_per_block=1, sample_size=tiny.resolution)
    with torch.no_grad():  # batch-norm statistics away from (0, 1), so decoding exercises them
        vae.bn.running_mean.copy_(torch.linspace(-0.2, 0.2, vae.bn.running_mean.numel()))
        vae.bn.running_var.copy_(torch.linspace(0.5, 1.5, vae.bn.running_var.numel()))
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=4 * z, num_layers=tiny.num_layers, num_single_layers=tiny.num_layers,
        attention_head_dim=tiny.attention_head_dim, num_attention_heads=tiny.num_attention_heads,
        joint_attention_dim=len(layers) * h, timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4)
        if tiny.attention_head_dim == 16 else tuple([tiny.attention_head_dim // 4] * 4), guidance_embeds=False)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True)
    pipe = Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                              transformer=transformer, is_distilled=False)
    return pipe, {"text_encoder_out_layers": layers}


def build_tiny_zimage_pipeline(tiny, seed: int = 0):
    """A tiny Z-Image-architecture pipeline: a Qwen3 text encoder with the offline byte-level tokenizer and a chat
    template, a 2x FLUX-style VAE with 4 latent channels (scaling and shift factors away from 1 and 0, so decoding
    exercises them), a single-stream transformer with 2 x 2 patches, and Z-Image-Turbo's scheduler (static shift 3)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(seed)
    tokenizer = build_tiny_byte_level_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    h = tiny.text_hidden
    text_encoder = Qwen3Model(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=h, intermediate_size=2 * h, num_hidden_layers=max(2, tiny.text_layers),
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None))
    vae = AutoencoderKL(block_out_channels=(16, 32), down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=8,
                        layers_per_block=1, sample_size=tiny.resolution, scaling_factor=0.3611, shift_factor=0.1159)
    heads = tiny.num_attention_heads
    dim = heads * tiny.attention_head_dim
    spatial = tiny.attention_head_dim // 8 * 3  # rope axes (t, h, w) summing to the head width: 8, 12, 12 for 32
    axes = [tiny.attention_head_dim - 2 * spatial, spatial, spatial]
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=dim, n_layers=tiny.num_layers,
        n_refiner_layers=1, n_heads=heads, n_kv_heads=heads, cap_feat_dim=h, axes_dims=axes, axes_lens=[256, 64, 64])
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    return ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                          transformer=transformer)


def build_tiny_wan_pipeline(tiny, seed: int = 0):
    """A tiny Wan 2.1-architecture text-to-video pipeline: a UMT5 encoder with the offline byte-level tokenizer, a
    Wan VAE with 2x spatial and 2x temporal compression and 4 latent channels, the 3D transformer, and the
    flow-matching scheduler with Wan's shift. ``tiny.experts = 2``: Wan 2.2 A14B's two experts."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    tokenizer = build_tiny_byte_level_tokenizer()
    h = tiny.text_hidden
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), d_model=h, d_kv=16, d_ff=2 * h,
                                               num_layers=tiny.text_layers, num_heads=2,
                                               pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                               decoder_start_token_id=tokenizer.pad_token_id))
    z = 4
    vae = AutoencoderKLWan(base_dim=16, z_dim=z, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True],
                           latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.8, 1.2, 2.0])
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=tiny.num_attention_heads, attention_head_dim=tiny.attention_head_dim,
        in_channels=z, out_channels=z, text_dim=h, freq_dim=32, ffn_dim=2 * tiny.attention_head_dim,
        num_layers=tiny.num_layers, rope_max_seq_len=64)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)  # Wan 2.1's flow shift at 480p
    if tiny.experts == 1:
        return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                           transformer=transformer)
    # Wan 2.2 A14B's layout: a second (low-noise) expert of the same architecture, switched at 0.875 x 1000
    low_noise = WanTransformer3DModel.from_config(transformer.config)
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                       transformer=transformer, transformer_2=low_noise, boundary_ratio=0.875)



def build_tiny_hunyuanvideo15_pipeline(tiny, seed: int = 0):
    """A tiny HunyuanVideo 1.5-architecture text-to-video pipeline: a Qwen2.5-VL text model with the offline
    byte-level tokenizer and a chat template (a short system message, the template's prefix cropped as the pipeline
    crops its own), a ByT5 glyph encoder with ByT5's byte tokenizer, a VAE with 2x spatial and 2x temporal
    compression and 4 latent channels, the transformer (its input: latents, condition latents and their mask), the
    flow-matching scheduler with a static shift, and classifier-free guidance switched off in the guider (flowrl
    applies CFG itself). The pipeline's text lengths and vision-token count are shrunk to the tiny model's."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        ClassifierFreeGuidance,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    tokenizer = build_tiny_byte_level_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    h = tiny.text_hidden
    text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        hidden_size=h, intermediate_size=2 * h, num_hidden_layers=max(3, tiny.text_layers), num_attention_heads=2,
        num_key_value_heads=1, vocab_size=len(tokenizer), max_position_embeddings=512,
        rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    byt5 = ByT5Tokenizer()
    glyph_encoder = T5EncoderModel(T5Config(vocab_size=len(byt5), d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                            num_heads=2, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    z = 4
    vae = AutoencoderKLHunyuanVideo15(latent_channels=z, block_out_channels=(16, 32), layers_per_block=1,
                                      spatial_compression_ratio=2, temporal_compression_ratio=2, scaling_factor=0.7)
    head = tiny.attention_head_dim
    spatial = head // 8 * 3  # rope axes (t, h, w) summing to the head width
    transformer = HunyuanVideo15Transformer3DModel(
        in_channels=2 * z + 1, out_channels=z, num_attention_heads=tiny.num_attention_heads, attention_head_dim=head,
        num_layers=tiny.num_layers, num_refiner_layers=1, patch_size=2, patch_size_t=1, text_embed_dim=h,
        text_embed_2_dim=16, image_embed_dim=16, rope_axes_dim=(head - 2 * spatial, spatial, spatial),
        target_size=tiny.resolution, task_type="t2v")
    pipe = HunyuanVideo15Pipeline(
        text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer, vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), text_encoder_2=glyph_encoder, tokenizer_2=byt5,
        guider=ClassifierFreeGuidance(guidance_scale=1.0, enabled=False))
    pipe.system_message = "Describe the video."
    empty = tokenizer.apply_chat_template([[{"role": "system", "content": pipe.system_message},
                                            {"role": "user", "content": ""}]], tokenize=True)
    pipe.prompt_template_encode_start_idx = len(empty[0] if isinstance(empty[0], list) else empty) - 2
    pipe.tokenizer_max_length = max(8, tiny.max_tokens)
    pipe.tokenizer_2_max_length = 8
    pipe.vision_num_semantic_tokens = 4
    return pipe


def build_tiny_ltx2_pipeline(tiny, seed: int = 0):
    """A tiny LTX-2-architecture audio-video pipeline: a Gemma 3 text encoder (a tiny vision tower included, as the
    class requires) with the offline byte-level tokenizer, the text connectors that turn Gemma's stacked hidden states
    into the video and audio streams' text tokens, a video VAE with 4x spatial and 4x temporal compression and 4 latent
    channels, an audio VAE (8 mel bins to 2 x 2 latents per audio frame), a vocoder, and the dual-stream transformer
    whose video and audio tokens are both 4 wide."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    torch.manual_seed(seed)
    tokenizer = build_tiny_byte_level_tokenizer()
    h, layers = tiny.text_hidden, tiny.text_layers
    text_encoder = Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=h, intermediate_size=2 * h,
                                     num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                                     head_dim=max(8, h // 2), max_position_embeddings=512, sliding_window=8,
                                     pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                     bos_token_id=tokenizer.eos_token_id),
        vision_config=SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, image_size=14, patch_size=7),
        mm_tokens_per_image=4, image_token_index=len(tokenizer) - 1))
    connector = dict(num_attention_heads=2, attention_head_dim=h // 2, num_layers=1, num_learnable_registers=None)
    connectors = LTX2TextConnectors(caption_channels=h, text_proj_in_factor=layers + 1, connector_rope_base_seq_len=32,
                                    rope_double_precision=False, rope_type="split",
                                    **{f"{stream}_connector_{k}": v for stream in ("video", "audio")
                                       for k, v in connector.items()})
    z = 4
    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=z, block_out_channels=(8, 8), decoder_block_out_channels=(8, 8),
        layers_per_block=(1, 1, 1), decoder_layers_per_block=(1, 1, 1), spatio_temporal_scaling=(True, True),
        decoder_spatio_temporal_scaling=(True, True), decoder_inject_noise=(False, False, False),
        downsample_type=("spatial", "spatiotemporal"), upsample_residual=(False, False), upsample_factor=(1, 1),
        timestep_conditioning=False, patch_size=1, patch_size_t=1, encoder_causal=True, decoder_causal=False)
    mel_bins, audio_channels = 8, 2
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=audio_channels, norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=mel_bins)
    vocoder = LTX2Vocoder(in_channels=2 * mel_bins, hidden_channels=16, out_channels=2, upsample_kernel_sizes=[4, 4],
                          upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
                          leaky_relu_negative_slope=0.1, output_sampling_rate=16000)
    head, audio_tokens = tiny.attention_head_dim, audio_channels * mel_bins // audio_vae.mel_compression_ratio
    heads = tiny.num_attention_heads
    transformer = LTX2VideoTransformer3DModel(
        in_channels=z, out_channels=z, patch_size=1, patch_size_t=1, num_attention_heads=heads,
        attention_head_dim=head, cross_attention_dim=heads * head,
        vae_scale_factors=(vae.temporal_compression_ratio, vae.spatial_compression_ratio, vae.spatial_compression_ratio),
        audio_in_channels=audio_tokens, audio_out_channels=audio_tokens, audio_num_attention_heads=heads,
        audio_attention_head_dim=head // 2, audio_cross_attention_dim=heads * head // 2, num_layers=tiny.num_layers,
        caption_channels=h, rope_double_precision=False, rope_type="split")
    return LTX2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, audio_vae=audio_vae,
                        text_encoder=text_encoder, tokenizer=tokenizer, connectors=connectors,
                        transformer=transformer, vocoder=vocoder)
