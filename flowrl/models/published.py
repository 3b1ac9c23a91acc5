"""Published architectures with random weights: every component of a real pipeline at its published size (the
transformer, the VAE, the text encoders) and the reward model beside it, built from configs written here, so that a
shipped preset can train end to end at real size on a machine with no weights and no network (``flowrl
gpu-check``'s end-to-end stage). Each component is constructed directly on the accelerator where there is one, in
bf16 (fp32 on a CPU): no host copy of a 10 GB encoder is made first.

Registered as ``model.pretrained`` names: ``random-sd3.5-medium`` (Stable Diffusion 3.5 Medium: MMDiT-X 2.5B,
CLIP-L/14, OpenCLIP bigG/14, T5-v1.1-XXL, the 16-channel VAE), and ``random-sd3.5-medium-shrunk``, the same
pipeline classes shrunk to run on a CPU (the test suite's). Differences from the published checkpoints: the T5
encoder's vocabulary holds the CLIP tokenizer's 49,408 ids (no T5 tokenizer ships offline; 32,128 in the
published one: 1.5% more weights), and every weight is random, so images are noise and rewards arbitrary; what
is measured is time and memory.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

# The published transformer/config.json of the presets' checkpoints (class, config), so that no download is needed.
SD35_MEDIUM = dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24, attention_head_dim=64,
                   num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                   pooled_projection_dim=2048, pos_embed_max_size=384, qk_norm="rms_norm",
                   dual_attention_layers=tuple(range(13)))
FLUX1_DEV = dict(patch_size=1, in_channels=64, out_channels=None, num_layers=19, num_single_layers=38,
                 attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                 guidance_embeds=True, axes_dims_rope=(16, 56, 56))
QWEN_IMAGE = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                  num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56))
WAN21_14B = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
                 text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
                 qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None,
                 rope_max_seq_len=1024)
WAN21_1_3B = dict(WAN21_14B, num_attention_heads=12, ffn_dim=8960, num_layers=30)
# Z-Image (Turbo and base, 6B): ZImageTransformer2DModel's defaults are the published configuration
ZIMAGE_6B = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30, n_refiner_layers=2,
                 n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560, rope_theta=256.0,
                 t_scale=1000.0, axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512])
# HunyuanVideo 1.5 text-to-video (8.3B): HunyuanVideo15Transformer3DModel's defaults are the published configuration;
# the 480p and 720p checkpoints differ in target_size
HUNYUANVIDEO15_480P = dict(in_channels=65, out_channels=32, num_attention_heads=16, attention_head_dim=128,
                           num_layers=54, num_refiner_layers=2, mlp_ratio=4.0, patch_size=1, patch_size_t=1,
                           qk_norm="rms_norm", text_embed_dim=3584, text_embed_2_dim=1472, image_embed_dim=1152,
                           rope_theta=256.0, rope_axes_dim=(16, 56, 56), target_size=480, task_type="t2v",
                           use_meanflow=False)
# LTX-2 (19B audio-video): the video stream (48 blocks, 32 heads x 128) and the audio stream (32 heads x 64) of
# LTX2VideoTransformer3DModel's published LTX-2.0 configuration; Gemma 3 12B's 3,840-wide hidden states feed both
LTX2_19B = dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
                attention_head_dim=128, cross_attention_dim=4096, vae_scale_factors=(8, 32, 32), pos_embed_max_pos=20,
                base_height=2048, base_width=2048, audio_in_channels=128, audio_out_channels=128, audio_patch_size=1,
                audio_patch_size_t=1, audio_num_attention_heads=32, audio_attention_head_dim=64,
                audio_cross_attention_dim=2048, audio_scale_factor=4, audio_pos_embed_max_pos=20,
                audio_sampling_rate=16000, audio_hop_length=160, num_layers=48, activation_fn="gelu-approximate",
                qk_norm="rms_norm_across_heads", norm_elementwise_affine=False, norm_eps=1e-6, caption_channels=3840,
                attention_bias=True, attention_out_bias=True, rope_theta=10000.0, causal_offset=1)
FLUX2_KLEIN_4B = dict(patch_size=1, in_channels=128, out_channels=None, num_layers=5, num_single_layers=20,
                      attention_head_dim=128, num_attention_heads=24, joint_attention_dim=7680,
                      timestep_guidance_channels=256, mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32),
                      rope_theta=2000, eps=1e-6, guidance_embeds=False)
# Stable Diffusion 3.5 Medium's components (their published config.json files)
SD35_CLIP_L = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                   projection_dim=768, max_position_embeddings=77, hidden_act="quick_gelu")
SD35_CLIP_G = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
                   projection_dim=1280, max_position_embeddings=77, hidden_act="gelu")
T5_XXL = dict(d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24, feed_forward_proj="gated-gelu",
              relative_attention_num_buckets=32, dense_act_fn="gelu_new", is_gated_act=True)
SD35_VAE = dict(in_channels=3, out_channels=3, latent_channels=16, down_block_types=("DownEncoderBlock2D",) * 4,
                up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
                norm_num_groups=32, sample_size=1024, scaling_factor=1.5305, shift_factor=0.0609,
                use_quant_conv=False, use_post_quant_conv=False)
# PickScore's reward model: a fine-tuned laion CLIP ViT-H/14 (logit scale 100), built by flowrl.rewards.pickscore
CLIP_VIT_H14 = dict(text=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                              max_position_embeddings=77, hidden_act="gelu"),
                    vision=dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16,
                                image_size=224, patch_size=14, hidden_act="gelu"),
                    projection_dim=1024, logit_scale_init_value=4.6052)

# the shrunk pipeline: the same classes, small enough for a CPU test
SHRUNK = {"transformer": dict(SD35_MEDIUM, num_layers=2, attention_head_dim=16, num_attention_heads=2,
                              joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=32,
                              pos_embed_max_size=32, dual_attention_layers=(0,)),
          "clip_l": dict(SD35_CLIP_L, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         projection_dim=16),
          "clip_g": dict(SD35_CLIP_G, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         projection_dim=16),
          "t5": dict(T5_XXL, d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=1),
          "vae": dict(SD35_VAE, block_out_channels=(8, 8, 16, 16), layers_per_block=1, norm_num_groups=4),
          "reward": dict(text=dict(CLIP_VIT_H14["text"], hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2),
                         vision=dict(CLIP_VIT_H14["vision"], hidden_size=16, intermediate_size=32,
                                     num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8),
                         projection_dim=16, logit_scale_init_value=4.6052)}
REAL = {"transformer": SD35_MEDIUM, "clip_l": SD35_CLIP_L, "clip_g": SD35_CLIP_G, "t5": T5_XXL, "vae": SD35_VAE,
        "reward": CLIP_VIT_H14}
CLIP_VOCAB = 49408  # the offline CLIP tokenizer's ids (tokens 49406 / 49407 begin and end a prompt)


def build_device() -> tuple[torch.device, torch.dtype]:
    """Where the random components are built: the GPU in bf16 where there is one, else the CPU in fp32."""
    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


@contextmanager
def built_on(device: torch.device, dtype: torch.dtype):
    """Modules constructed inside are allocated and initialised on ``device`` in ``dtype``."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def _clip_text(config: dict, device, dtype):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    with built_on(device, dtype):
        return CLIPTextModelWithProjection(CLIPTextConfig(**config, vocab_size=CLIP_VOCAB, bos_token_id=49406,
                                                          eos_token_id=49407, pad_token_id=49407)).eval()


def sd35_medium_pipeline(shrunk: bool = False, max_tokens: int = 256, seed: int = 0):
    """Stable Diffusion 3.5 Medium (or its shrunk twin) with random weights, on the accelerator where there is one;
    ``max_tokens`` T5 tokens per prompt (the presets' ``model.max_sequence_length``)."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import T5Config, T5EncoderModel

    from ..tokenizer import build_clip_tokenizer

    sizes = SHRUNK if shrunk else REAL
    device, dtype = build_device()
    torch.manual_seed(seed)
    with built_on(device, dtype):
        transformer = SD3Transformer2DModel(**sizes["transformer"])
        vae = AutoencoderKL(**sizes["vae"])
        t5 = T5EncoderModel(T5Config(**sizes["t5"], vocab_size=CLIP_VOCAB, is_encoder_decoder=False)).eval()
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        text_encoder=_clip_text(sizes["clip_l"], device, dtype), tokenizer=build_clip_tokenizer(77),
        text_encoder_2=_clip_text(sizes["clip_g"], device, dtype), tokenizer_2=build_clip_tokenizer(77),
        text_encoder_3=t5, tokenizer_3=build_clip_tokenizer(max_tokens))
    pipe.embedded_max_tokens = max_tokens
    return pipe


def random_sd35_medium(_=None):
    """``model.pretrained: random-sd3.5-medium``."""
    return sd35_medium_pipeline(shrunk=False)


def random_sd35_medium_shrunk(_=None):
    """``model.pretrained: random-sd3.5-medium-shrunk``."""
    return sd35_medium_pipeline(shrunk=True, max_tokens=16)
