"""Every model family on its tiny offline model: our rollout equals diffusers' own pipeline with noise off,
every algorithm trains one iteration with ratio == 1 on the first update, and the LoRA file a run saves loads
with the family's diffusers pipeline and draws what our policy draws."""

from pathlib import Path

import pytest
import torch

from flowrl.config import load_config
from flowrl.editing import EditPrompt
from flowrl.models import load_adapter
from flowrl.models.flux import pack
from flowrl.sampling import Sampler, sample_images, sigmas_for

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["a red circle on a blue background", "a green square on a white background"]
FAMILIES = {
    "sd3": ["model.family=sd3", "model.resolution=16"],
    "flux": ["model.family=flux", "model.resolution=32", "model.tiny.resolution=32"],
    "qwenimage": ["model.family=qwenimage", "model.resolution=32", "model.tiny.resolution=32"],
    "flux2": ["model.family=flux2", "model.resolution=32", "model.tiny.resolution=32"],
    "wan": ["model.family=wan", "model.resolution=32", "model.tiny.resolution=32", "model.num_frames=5"],
    "zimage": ["model.family=zimage", "model.resolution=32", "model.tiny.resolution=32"],
    "hunyuanvideo15": ["model.family=hunyuanvideo15", "model.resolution=32", "model.tiny.resolution=32",
                       "model.num_frames=5"],
    "ltx2": ["model.family=ltx2", "model.resolution=32", "model.tiny.resolution=32", "model.num_frames=5"],
    # an editing family: the shapes edit requests (their sources render offline)
    "flux-kontext": ["model.family=flux-kontext", "model.resolution=32", "model.tiny.resolution=32",
                     "data.prompt_set=shapes-edit-train"],
    "qwenimage-edit": ["model.family=qwenimage-edit", "model.resolution=32", "model.tiny.resolution=32",
                       "data.prompt_set=shapes-edit-train"],
    "qwenimage-edit-plus": ["model.family=qwenimage-edit-plus", "model.resolution=32", "model.tiny.resolution=32",
                            "data.prompt_set=shapes-edit-train"],
}
EDITING = ("flux-kontext", "qwenimage-edit", "qwenimage-edit-plus")
EDIT_PROMPTS = [EditPrompt("make the shape red", ["shapes:a green circle on a blue background#3"]),
                EditPrompt("make the background white", ["shapes:a red square on a black background#5"])]


def prompts_of(family_or_adapter) -> list[str]:
    """Two prompts the family takes: edit requests for an editing family, captions otherwise."""
    family = getattr(family_or_adapter, "family", family_or_adapter)
    return EDIT_PROMPTS if family in EDITING else PROMPTS
REWARD = {f: "rewards=[{name: 'tests.helpers:brightness'}]" for f in FAMILIES}
REWARD["wan"] = "rewards=[{name: video_frames, args: {reward: 'tests.helpers:brightness'}}]"  # videos (N, F, 3, H, W)
REWARD["hunyuanvideo15"] = REWARD["ltx2"] = REWARD["wan"]
# each algorithm's own options, sized for a 4-step tiny run
ALGORITHMS = {
    "flow_grpo": [], "flow_grpo_fast": ["algorithm.window.size=1"], "mix_grpo": ["algorithm.window.size=2"],
    "dance_grpo": [], "branch_grpo": ["algorithm.split_steps=[0, 1]"], "tempflow_grpo": ["algorithm.group_size=2"],
    "e_grpo": ["algorithm.group_size=2"], "chunk_grpo": ["algorithm.sizes=[1, 2]"],
    "superflow": ["algorithm.min_group=2", "algorithm.max_group=3"], "ada_grpo": ["algorithm.candidates=2"],
    "diffusion_nft": ["algorithm.group_size=2", "algorithm.timesteps_per_sample=1"],
    "flow_dppo": ["train.inner_epochs=2"], "delightful_pg": [],
    "customized_grpo": ["algorithm.group_size=2"], "awm": ["algorithm.group_size=2", "algorithm.timesteps_per_sample=1"],
    "sft": ["algorithm.group_size=2", "algorithm.timesteps_per_sample=1"],
    "online_dpo": ["algorithm.group_size=2", "algorithm.timesteps_per_sample=1"],
    "dgpo": ["algorithm.group_size=2", "algorithm.timesteps_per_sample=1"], "gardo": ["train.kl_beta=0.04"],
    "refl": [], "on_policy_distillation": ["train.kl_beta=1.0"],
    "euphonium": ["sampler.kernel=dance", "algorithm.guidance_start=2", "algorithm.group_size=2"],
    "ac_flow": ["algorithm.group_size=2", "algorithm.timesteps_per_sample=1", "algorithm.critic_warmup=0"],
    "tree_grpo": ["algorithm.branch_factor=2", "algorithm.depth=2"],
    "diverse_grpo": ["train.kl_beta=0.5"],
    "flash_grpo": ["algorithm.group_size=2"],
    "sol_rl": ["algorithm.group_size=2", "algorithm.timesteps_per_sample=1", "sampler.pool.size=4",
               "sampler.pool.num_steps=2"],
}
DIFFERENTIABLE = {f: "tests.helpers:brightness" for f in FAMILIES}
DIFFERENTIABLE["wan"] = DIFFERENTIABLE["hunyuanvideo15"] = DIFFERENTIABLE["ltx2"] = "tests.helpers:video_brightness"
# re-noised samples or re-runs
NO_EDGES = ("diffusion_nft", "sol_rl", "awm", "sft", "online_dpo", "dgpo", "refl", "ac_flow")
# objectives without a policy ratio (the matching error, a preference, the reward's gradient): no ratio statistics
NO_RATIO = ("diffusion_nft", "sol_rl", "awm", "sft", "online_dpo", "refl", "ac_flow")
RATIO_STATISTICS = {"clipfrac", "approx_kl", "ratio_mean", "ratio_std", "ratio_max_abs_dev_first_update",
                    "mean_abs_log_ratio"}


# the quick suite (`make test`) runs these on SD3; the other families' runs are heavy (`make test-heavy`, CI)
FAMILIES_SD3_QUICK = [pytest.param(f, marks=() if f == "sd3" else pytest.mark.heavy) for f in FAMILIES]


def family_cfg(family, *extra):
    return load_config(None, [*FAMILIES[family], "log.progress=false", *extra])


def test_flux_rollout_equals_flux_pipeline():
    """Noise off, same weights, prompt, initial noise, sigmas and guidance: FluxPipeline's images exactly."""
    from diffusers import FluxPipeline

    from flowrl.models.flux import pack

    cfg = family_cfg("flux")
    adapter = load_adapter(cfg.model)
    shape = adapter.latent_shape(32)
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(3))[None]  # what sample_images draws for seed 3
    sig = sigmas_for(cfg, adapter, 4)
    ours = torch.cat([sample_images(adapter, [p], [3], sig, shape) for p in PROMPTS])
    pipe: FluxPipeline = adapter.pipe
    for k, p in enumerate(PROMPTS):
        ref = pipe(prompt=[p], height=32, width=32, num_inference_steps=4, guidance_scale=3.5,
                   latents=pack(noise), output_type="pt", max_sequence_length=16).images
        assert torch.allclose(ours[k: k + 1], ref, atol=1e-5), (ours[k: k + 1] - ref).abs().max()
    # true CFG (a negative prompt and a scale > 1) against the pipeline's true_cfg_scale
    cfg = family_cfg("flux", "sampler.guidance_scale=2.0", "sampler.negative_prompt=a blur")
    with torch.no_grad():
        ours = Sampler(cfg, adapter, num_steps=4)([PROMPTS[0]], [3])
    ref = pipe(prompt=[PROMPTS[0]], negative_prompt=["a blur"], true_cfg_scale=2.0, height=32, width=32,
               num_inference_steps=4, guidance_scale=3.5, latents=pack(noise), output_type="pt",
               max_sequence_length=16).images
    assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()


def test_qwenimage_rollout_equals_qwenimage_pipeline():
    """Noise off: QwenImagePipeline's images, with and without its norm-rescaled true CFG; prompts of different
    token counts batched together (padded, masked) give what each gives alone."""
    from flowrl.models.flux import pack

    cfg = family_cfg("qwenimage")
    adapter = load_adapter(cfg.model)
    shape = adapter.latent_shape(32)
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(3))[None]
    sig = sigmas_for(cfg, adapter, 4)
    prompts = [PROMPTS[0], "a cat"]  # 8 and 2 words: different token counts
    alone = torch.cat([sample_images(adapter, [p], [3], sig, shape) for p in prompts])
    for k, p in enumerate(prompts):
        ref = adapter.pipe(prompt=[p], height=32, width=32, num_inference_steps=4, true_cfg_scale=1.0,
                           latents=pack(noise), output_type="pt").images
        assert torch.allclose(alone[k: k + 1], ref, atol=1e-5), (alone[k: k + 1] - ref).abs().max()
    assert adapter.encode_prompts(prompts).mask.sum(1).tolist()[1] < adapter.encode_prompts(prompts).mask.shape[1]
    together = sample_images(adapter, prompts, [3], sig, shape)
    assert torch.allclose(together, alone, atol=1e-5), (together - alone).abs().max()
    cfg = family_cfg("qwenimage", "sampler.guidance_scale=4.0", "sampler.negative_prompt=a blur")
    with torch.no_grad():
        ours = Sampler(cfg, adapter, num_steps=4)([PROMPTS[0]], [3])
    ref = adapter.pipe(prompt=[PROMPTS[0]], negative_prompt=["a blur"], true_cfg_scale=4.0, height=32, width=32,
                       num_inference_steps=4, latents=pack(noise), output_type="pt").images
    assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()


def test_flux2_rollout_equals_flux2_pipeline():
    """Noise off: Flux2KleinPipeline's images (its latents are the normalised, patchified ones the engine uses),
    with and without CFG against the empty prompt."""
    cfg = family_cfg("flux2")
    adapter = load_adapter(cfg.model)
    shape = adapter.latent_shape(32)
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(3))[None]
    sig = sigmas_for(cfg, adapter, 4)
    common = dict(height=32, width=32, num_inference_steps=4, latents=noise, output_type="pt", max_sequence_length=16,
                  text_encoder_out_layers=adapter.text_encoder_out_layers)
    for p in PROMPTS:
        ref = adapter.pipe(prompt=[p], guidance_scale=1.0, **common).images
        ours = sample_images(adapter, [p], [3], sig, shape)
        assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()
    cfg = family_cfg("flux2", "sampler.guidance_scale=4.0", "sampler.negative_prompt=")
    with torch.no_grad():
        ours = Sampler(cfg, adapter, num_steps=4)([PROMPTS[0]], [3])
    ref = adapter.pipe(prompt=[PROMPTS[0]], guidance_scale=4.0, **common).images
    assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()


def test_zimage_rollout_equals_zimage_pipeline():
    """Noise off: ZImagePipeline's images, without CFG (Turbo's setting) and with it (the pipeline's guidance_scale
    g is ours minus 1), prompts of different token counts."""
    cfg = family_cfg("zimage", "sampler.guidance_scale=4.0", "sampler.negative_prompt=")
    adapter = load_adapter(cfg.model)
    shape = adapter.latent_shape(32)
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(3))[None]
    common = dict(height=32, width=32, num_inference_steps=4, latents=noise, output_type="pt",
                  max_sequence_length=adapter.max_sequence_length)
    sig = sigmas_for(cfg, adapter, 4)
    for p in PROMPTS:
        ref = adapter.pipe(prompt=p, guidance_scale=0.0, **common).images
        ours = sample_images(adapter, [p], [3], sig, shape)
        assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()
    with torch.no_grad():
        ours = Sampler(cfg, adapter, num_steps=4)([PROMPTS[0]], [3])
    ref = adapter.pipe(prompt=PROMPTS[0], negative_prompt="", guidance_scale=3.0, **common).images
    assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()


def test_zimage_first_sde_step_mean_equals_the_pipeline_transformers():
    """The first SDE step (sigma 1 -> the grid's next) of a batch whose prompts have different token counts: its mean
    from our velocity equals the one from ZImagePipeline's transformer called on each prompt's own tokens."""
    from flowrl.samplers.kernels import step as kernel_step

    cfg = family_cfg("zimage")
    adapter = load_adapter(cfg.model)
    prompts = ["a cat", PROMPTS[0]]
    x = torch.randn((2, *adapter.latent_shape(32)), generator=torch.Generator().manual_seed(1))
    cond = adapter.encode_prompts(prompts)  # padded to the longer prompt, with a mask
    sig = sigmas_for(cfg, adapter, 4)
    s, s_next = sig[:1].expand(2), sig[1:2].expand(2)
    with torch.no_grad():
        v = adapter.velocity(x, s, cond)
        embeds = [adapter.pipe._encode_prompt([p], device="cpu", max_sequence_length=adapter.max_sequence_length)[0]
                  for p in prompts]
        out = adapter.pipe.transformer(list(x.unsqueeze(2).unbind(0)), 1 - s, embeds, return_dict=False)[0]
    v_pipe = -torch.stack(out).squeeze(2)
    assert cond.mask is not None and not cond.mask.all()
    noise = torch.zeros_like(x)
    ours = kernel_step("flow_grpo", x, v, s, s_next, noise_level=0.7, sigma_at_one=float(sig[1]), noise=noise)
    theirs = kernel_step("flow_grpo", x, v_pipe, s, s_next, noise_level=0.7, sigma_at_one=float(sig[1]), noise=noise)
    assert torch.allclose(ours.mean, theirs.mean, atol=1e-6), (ours.mean - theirs.mean).abs().max()


def test_flux_kontext_rollout_equals_flux_kontext_pipeline():
    """Noise off, the same source image and instruction: FluxKontextPipeline's images (at model.resolution, no
    auto-resize), for two sources; another source changes the result."""
    from flowrl.editing import load_source

    cfg = family_cfg("flux-kontext")
    adapter = load_adapter(cfg.model)
    shape = adapter.latent_shape(32)
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(3))[None]
    sig = sigmas_for(cfg, adapter, 4)
    results = []
    for request in EDIT_PROMPTS:
        ours = sample_images(adapter, [request], [3], sig, shape)
        image = load_source(request.sources[0], 32)
        ref = adapter.pipe(prompt=str(request), image=image, height=32, width=32, max_area=32 * 32,
                           _auto_resize=False, num_inference_steps=4, latents=pack(noise), guidance_scale=3.5,
                           output_type="pt", max_sequence_length=adapter.max_sequence_length).images
        assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()
        results.append(ours)
    swapped = sample_images(adapter, [EditPrompt(str(EDIT_PROMPTS[0]), EDIT_PROMPTS[1].sources)], [3], sig, shape)
    assert (swapped - results[0]).abs().max() > 1e-4  # the source conditions the result


def test_qwenimage_edit_rollout_equals_qwenimage_edit_pipeline(monkeypatch):
    """Noise off, the same source and instruction: QwenImageEditPipeline's images, without CFG and with its true CFG
    (the negative prompt read with the source too); the source reaches both the text encoder and the tokens. The
    pipeline's one-megapixel source size is patched to the tiny model's own, which the adapter reads sources at."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as edit_module

    from flowrl.editing import load_source

    monkeypatch.setattr(edit_module, "calculate_dimensions", lambda area, ratio: (32, 32, None))
    cfg = family_cfg("qwenimage-edit", "sampler.guidance_scale=4.0", "sampler.negative_prompt=blurry")
    adapter = load_adapter(cfg.model)
    shape = adapter.latent_shape(32)
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(3))[None]
    sig = sigmas_for(cfg, adapter, 4)
    request = EDIT_PROMPTS[0]
    common = dict(image=load_source(request.sources[0], 32), prompt=str(request), height=32, width=32,
                  num_inference_steps=4, latents=pack(noise), output_type="pt")
    ours = sample_images(adapter, [request], [3], sig, shape)
    ref = adapter.pipe(true_cfg_scale=1.0, **common).images
    assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()
    with torch.no_grad():
        ours_cfg = Sampler(cfg, adapter, num_steps=4)([request], [3])
    ref_cfg = adapter.pipe(true_cfg_scale=4.0, negative_prompt="blurry", **common).images
    assert torch.allclose(ours_cfg, ref_cfg, atol=1e-5), (ours_cfg - ref_cfg).abs().max()
    other = EditPrompt(str(request), EDIT_PROMPTS[1].sources)
    a, b = adapter.encode_prompts([request]), adapter.encode_prompts([other])
    assert not torch.equal(a.embeds, b.embeds) and not torch.equal(a.reference, b.reference)


def test_qwenimage_edit_plus_rollout_equals_its_pipeline_with_two_sources(monkeypatch):
    """Noise off, the same instruction over two source images: QwenImageEditPlusPipeline's images, without CFG and
    with its true CFG (the negative prompt read with the sources too). The pipeline's source sizes (384 x 384 for the
    text encoder, one megapixel for the VAE) are patched to the tiny model's own, which the adapter reads them at.
    Swapping the two sources changes the result: each keeps its place in the sequence."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus_module

    from flowrl.editing import load_source

    monkeypatch.setattr(plus_module, "calculate_dimensions", lambda area, ratio: (32, 32))
    cfg = family_cfg("qwenimage-edit-plus", "sampler.guidance_scale=4.0", "sampler.negative_prompt=blurry")
    adapter = load_adapter(cfg.model)
    shape = adapter.latent_shape(32)
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(3))[None]
    sig = sigmas_for(cfg, adapter, 4)
    sources = [EDIT_PROMPTS[0].sources[0], EDIT_PROMPTS[1].sources[0]]
    request = EditPrompt("put the shape of picture 2 on picture 1", sources)
    common = dict(image=[load_source(k, 32) for k in sources], prompt=str(request), height=32, width=32,
                  num_inference_steps=4, latents=pack(noise), output_type="pt")
    ours = sample_images(adapter, [request], [3], sig, shape)
    ref = adapter.pipe(true_cfg_scale=1.0, **common).images
    assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()
    with torch.no_grad():
        ours_cfg = Sampler(cfg, adapter, num_steps=4)([request], [3])
    ref_cfg = adapter.pipe(true_cfg_scale=4.0, negative_prompt="blurry", **common).images
    assert torch.allclose(ours_cfg, ref_cfg, atol=1e-5), (ours_cfg - ref_cfg).abs().max()
    assert adapter.encode_prompts([request]).reference.shape[:2] == (1, 2)
    swapped = sample_images(adapter, [EditPrompt(str(request), sources[::-1])], [3], sig, shape)
    assert (swapped - ours).abs().max() > 1e-4
    with pytest.raises(Exception, match="at most 3"):
        adapter.encode_prompts([EditPrompt(str(request), sources * 2)])


def test_hunyuanvideo15_rollout_equals_its_pipeline():
    """Videos: noise off, HunyuanVideo15Pipeline's frames (its two text streams, a prompt with quoted glyph text and
    one without), without CFG and with it (the guider's scale equals ours)."""
    from diffusers import ClassifierFreeGuidance

    cfg = family_cfg("hunyuanvideo15", "sampler.guidance_scale=4.0", "sampler.negative_prompt=")
    adapter = load_adapter(cfg.model)
    shape = adapter.latent_shape(32)
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(3))[None]
    common = dict(height=32, width=32, num_frames=5, num_inference_steps=4, latents=noise, output_type="pt")
    sig = sigmas_for(cfg, adapter, 4)
    for p in [PROMPTS[0], 'a sign that says "OPEN"']:
        ours = sample_images(adapter, [p], [3], sig, shape)
        ref = adapter.pipe(prompt=p, **common).frames
        assert ours.shape == (1, 5, 3, 32, 32) and torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()
    glyphs = adapter.encode_prompts(['a sign that says "OPEN"', PROMPTS[0]]).extra["glyph_mask"]
    assert glyphs[0].sum() > 0 and glyphs[1].sum() == 0  # quoted text reaches the ByT5 stream
    adapter.pipe.guider = ClassifierFreeGuidance(guidance_scale=4.0)
    with torch.no_grad():
        ours = Sampler(cfg, adapter, num_steps=4)([PROMPTS[0]], [3])
    ref = adapter.pipe(prompt=PROMPTS[0], negative_prompt="", **common).frames
    assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()


def test_hunyuanvideo15_first_sde_step_mean_equals_the_pipeline_transformers():
    """The first SDE step of a batch of two prompts (one with quoted glyph text): its mean from our velocity equals
    the one from HunyuanVideo15Pipeline's transformer called with the pipeline's own encodings and inputs."""
    from flowrl.samplers.kernels import step as kernel_step

    cfg = family_cfg("hunyuanvideo15")
    adapter = load_adapter(cfg.model)
    pipe, prompts = adapter.pipe, [PROMPTS[0], 'a sign that says "OPEN"']
    x = torch.randn((2, *adapter.latent_shape(32)), generator=torch.Generator().manual_seed(1))
    sig = sigmas_for(cfg, adapter, 4)
    s, s_next = sig[:1].expand(2), sig[1:2].expand(2)
    with torch.no_grad():
        v = adapter.velocity(x, s, adapter.encode_prompts(prompts))
        e, m, e2, m2 = pipe.encode_prompt(prompt=prompts, device="cpu", dtype=torch.float32, batch_size=2)
        cond_latents, mask = pipe.prepare_cond_latents_and_mask(x, torch.float32, "cpu")
        vision = torch.zeros(2, pipe.vision_num_semantic_tokens, pipe.vision_states_dim)
        v_pipe = pipe.transformer(hidden_states=torch.cat([x, cond_latents, mask], 1), image_embeds=vision,
                                  timestep=s * 1000, encoder_hidden_states=e, encoder_attention_mask=m,
                                  encoder_hidden_states_2=e2, encoder_attention_mask_2=m2, return_dict=False)[0]
    noise = torch.zeros_like(x)
    ours = kernel_step("flow_grpo", x, v, s, s_next, noise_level=0.7, sigma_at_one=float(sig[1]), noise=noise)
    theirs = kernel_step("flow_grpo", x, v_pipe, s, s_next, noise_level=0.7, sigma_at_one=float(sig[1]), noise=noise)
    assert torch.allclose(ours.mean, theirs.mean, atol=1e-6), (ours.mean - theirs.mean).abs().max()


LTX2_PLAIN_GUIDANCE = dict(stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0, audio_modality_scale=1.0,
                          guidance_rescale=0.0, audio_guidance_rescale=0.0, spatio_temporal_guidance_blocks=None)


def test_ltx2_rollout_equals_its_pipeline(monkeypatch):
    """Noise off: LTX2Pipeline's frames and its final audio latents (the audio stream is denoised beside the video),
    without CFG and with it (the pipeline's x0-space CFG at one scale for both streams equals ours); the pipeline's
    further guidance terms off."""
    cfg = family_cfg("ltx2", "sampler.guidance_scale=4.0", "sampler.negative_prompt=")
    adapter = load_adapter(cfg.model)
    shape = adapter.latent_shape(32)
    video_tokens = adapter.image_seq_len(32)
    assert shape == (2 * 8 * 8 + 5, 4) and video_tokens == 128  # 5 frames -> 2 latent frames of 8 x 8; 5 audio frames
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(3))[None]
    common = dict(height=32, width=32, num_frames=5, num_inference_steps=4, latents=noise[:, :video_tokens],
                  audio_latents=noise[:, video_tokens:], max_sequence_length=cfg.model.tiny.max_tokens,
                  **LTX2_PLAIN_GUIDANCE)
    sig = sigmas_for(cfg, adapter, 4)
    finals = []
    decode = adapter.decode
    monkeypatch.setattr(adapter, "decode", lambda z: finals.append(z) or decode(z))
    for g, sampled in ((1.0, lambda: sample_images(adapter, [PROMPTS[0]], [3], sig, shape)),
                       (4.0, lambda: Sampler(cfg, adapter, num_steps=4)([PROMPTS[0]], [3]))):
        with torch.no_grad():
            ours = sampled()
        kwargs = dict(common, guidance_scale=g, audio_guidance_scale=g, negative_prompt="")
        ref = adapter.pipe(prompt=PROMPTS[0], output_type="pt", **kwargs).frames
        assert ours.shape == (1, 5, 3, 32, 32) and torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()
        audio = adapter.pipe(prompt=PROMPTS[0], output_type="latent", **kwargs).audio  # (1, C, L, M) unpacked
        packed = adapter.pipe._pack_audio_latents(audio)
        assert torch.allclose(finals[-1][:, video_tokens:], packed, atol=1e-5), (finals[-1][:, video_tokens:] - packed).abs().max()
    other = sample_images(adapter, [PROMPTS[1]], [3], sig, shape)
    assert (other - ours).abs().max() > 1e-3  # the prompt reaches the video


def test_ltx2_first_sde_step_mean_equals_the_pipeline_transformers():
    """The first SDE step of a batch of two prompts: its mean from our velocity equals the one from LTX2Pipeline's
    transformer called with the pipeline's own batched encodings (Gemma 3, then the connectors) and inputs."""
    from flowrl.samplers.kernels import step as kernel_step

    cfg = family_cfg("ltx2")
    adapter = load_adapter(cfg.model)
    pipe, n_video = adapter.pipe, adapter.image_seq_len(32)
    x = torch.randn((2, *adapter.latent_shape(32)), generator=torch.Generator().manual_seed(1))
    sig = sigmas_for(cfg, adapter, 4)
    s, s_next = sig[:1].expand(2), sig[1:2].expand(2)
    with torch.no_grad():
        v = adapter.velocity(x, s, adapter.encode_prompts(PROMPTS))
        e, m, _, _ = pipe.encode_prompt(prompt=PROMPTS, do_classifier_free_guidance=False,
                                        max_sequence_length=cfg.model.tiny.max_tokens, device="cpu")
        video_text, audio_text, mask = pipe.connectors(e, m, padding_side="left")
        t = s * 1000
        v_video, v_audio = pipe.transformer(
            hidden_states=x[:, :n_video], audio_hidden_states=x[:, n_video:], encoder_hidden_states=video_text,
            audio_encoder_hidden_states=audio_text, timestep=t, sigma=t, encoder_attention_mask=mask,
            audio_encoder_attention_mask=mask, num_frames=2, height=8, width=8, fps=24.0, audio_num_frames=5,
            use_cross_timestep=True, return_dict=False)
    v_pipe = torch.cat([v_video, v_audio], 1)
    noise = torch.zeros_like(x)
    ours = kernel_step("flow_grpo", x, v, s, s_next, noise_level=0.7, sigma_at_one=float(sig[1]), noise=noise)
    theirs = kernel_step("flow_grpo", x, v_pipe, s, s_next, noise_level=0.7, sigma_at_one=float(sig[1]), noise=noise)
    assert torch.allclose(ours.mean, theirs.mean, atol=1e-6), (ours.mean - theirs.mean).abs().max()
    assert (v[0] - v[1]).abs().max() > 1e-4  # the two prompts differ


def test_wan_rollout_equals_wan_pipeline():
    """Videos: noise off, WanPipeline's frames (B, F, 3, H, W), with and without its CFG."""
    cfg = family_cfg("wan")
    adapter = load_adapter(cfg.model)
    shape = adapter.latent_shape(32)
    assert shape == (4, 3, 16, 16)  # 5 frames -> (5 - 1) / 2 + 1 latent frames with the tiny 2x temporal VAE
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(3))[None]
    common = dict(height=32, width=32, num_frames=5, num_inference_steps=4, latents=noise, output_type="pt",
                  max_sequence_length=16)
    ours = sample_images(adapter, ["a red circle moving left"], [3], sigmas_for(cfg, adapter, 4), shape)
    ref = adapter.pipe(prompt=["a red circle moving left"], guidance_scale=1.0, **common).frames
    assert ours.shape == ref.shape == (1, 5, 3, 32, 32)
    assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()
    cfg = family_cfg("wan", "sampler.guidance_scale=5.0", "sampler.negative_prompt=a blur")
    with torch.no_grad():
        ours = Sampler(cfg, adapter, num_steps=4)(["a red circle moving left"], [3])
    ref = adapter.pipe(prompt=["a red circle moving left"], negative_prompt=["a blur"], guidance_scale=5.0, **common).frames
    assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()


WAN22 = ["model.tiny.experts=2", "sampler.guidance_scale=5.0", "sampler.negative_prompt=a blur",
         "model.low_noise_guidance_scale=3.0"]


@pytest.mark.parametrize("expert", ["high_noise", "low_noise"])
def test_wan22_two_experts_equal_wan_pipeline(expert):
    """Wan 2.2 A14B's layout: steps at timestep >= 875 by the high-noise expert with CFG 5, the rest by the
    low-noise expert with CFG 3 (guidance_scale_2), as WanPipeline draws them, whichever expert is trained; a
    batch whose rows straddle the boundary gives what each row gives alone."""
    cfg = family_cfg("wan", *WAN22, f"model.train_expert={expert}")
    adapter = load_adapter(cfg.model)
    assert adapter.boundary == 875.0
    assert (adapter.transformer is adapter.pipe.transformer_2) == (expert == "low_noise")
    sigmas = sigmas_for(cfg, adapter, 4)
    assert (sigmas[:-1] * 1000 >= 875).sum() == 1  # one high-noise step, three low-noise ones
    shape = adapter.latent_shape(32)
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(3))[None]
    with torch.no_grad():
        ours = Sampler(cfg, adapter, num_steps=4)(["a red circle moving left"], [3])
    ref = adapter.pipe(prompt=["a red circle moving left"], negative_prompt=["a blur"], guidance_scale=5.0,
                       guidance_scale_2=3.0, height=32, width=32, num_frames=5, num_inference_steps=4, latents=noise,
                       output_type="pt", max_sequence_length=16).frames
    assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()
    x = torch.randn((3, *shape), generator=torch.Generator().manual_seed(1))
    sigma = torch.tensor([0.95, 0.5, 0.9])
    cond, neg = adapter.encode_prompts(PROMPTS + PROMPTS[:1]), adapter.encode_prompts(["a blur"])
    with torch.no_grad():
        together = adapter.velocity(x, sigma, cond, 5.0, neg)
        alone = torch.cat([adapter.velocity(x[i: i + 1], sigma[i: i + 1], cond.index(torch.tensor([i])), 5.0, neg)
                           for i in range(3)])
    assert torch.allclose(together, alone, atol=1e-5), (together - alone).abs().max()


def test_wan22_low_noise_lora_loads_into_transformer_2(tmp_path):
    """Train the low-noise expert's LoRA; WanPipeline loads the file with load_into_transformer_2=True and draws
    our policy's velocity; the frozen high-noise expert is untouched."""
    cfg = family_cfg("wan", "model.tiny.experts=2", "model.train_expert=low_noise", "sampler.num_steps=3",
                     "train.prompts_per_iter=1", "algorithm.group_size=2", "train.iterations=2", "train.lr=5e-2",
                     f"log.output_dir={tmp_path}", "log.run_name=l", "log.sample_every=0", REWARD["wan"])
    # one row per expert
    v_ours, v_pipe, v_base = trained_lora_velocities(tmp_path, cfg, torch.tensor([0.95, 0.4]),
                                                     load_into_transformer_2=True)
    assert torch.equal(v_ours[0], v_base[0])  # high noise: the frozen expert
    assert (v_ours[1] - v_base[1]).abs().max() > 1e-4  # low noise: the trained LoRA moved it
    assert torch.allclose(v_pipe, v_ours, atol=1e-5), (v_pipe - v_ours).abs().max()


def test_video_grids_are_a_frame_strip_and_a_gif(tmp_path):
    from PIL import Image

    from flowrl.report import save_grid

    videos = (torch.rand(4, 5, 3, 8, 8, generator=torch.Generator().manual_seed(0)) > 0.5).float()  # 8 colours: GIF-exact
    png = save_grid(videos, 2, tmp_path / "g.png", row_labels=["a", "b"])
    gif = Image.open(tmp_path / "g.gif")
    assert png.stat().st_size > 0 and gif.n_frames == 5
    # frame 2 of the GIF is the grid of every sample's third frame (64 px tiles, 2 px padding)
    gif.seek(2)
    import numpy as np

    tile = torch.from_numpy(np.array(gif.convert("RGB"))).float()
    expect = torch.nn.functional.interpolate(videos[:, 2], scale_factor=8, mode="nearest")[0].permute(1, 2, 0) * 255
    assert torch.equal(tile[2:66, 2:66], expect)
    import av

    with av.open(str(tmp_path / "g.mp4")) as container:  # the same grid as H.264 (lossy: compared loosely)
        decoded = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(decoded) == 5 and decoded[0].shape[:2] == (gif.height, gif.width)
    assert abs(torch.from_numpy(decoded[2][2:66, 2:66]).float() - expect).mean() < 20


def test_flux_sigmas_are_the_pipelines():
    """FluxPipeline's grid: linspace(1, 1/T, T) shifted by mu from the packed token count (64 here)."""
    import math

    cfg = family_cfg("flux")
    sig = sigmas_for(cfg, load_adapter(cfg.model), 4)
    mu = 64 * (1.15 - 0.5) / (4096 - 256) + (0.5 - (1.15 - 0.5) / (4096 - 256) * 256)
    expect = [math.exp(mu) / (math.exp(mu) + (1 / s - 1)) for s in (1.0, 0.75, 0.5, 0.25)] + [0.0]
    assert sig.tolist() == pytest.approx(expect, abs=1e-6)


@pytest.mark.parametrize("family", FAMILIES_SD3_QUICK)
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_every_algorithm_trains_on_every_family(tmp_path, family, algorithm):
    from flowrl.trainer import Trainer

    reward, extra = REWARD[family], []
    if algorithm in ("customized_grpo", "gardo"):  # two rewards (fused, or main and auxiliary): the same one twice
        reward = reward[:-1] + ", " + reward[len("rewards=["):]
    if algorithm == "refl":  # it differentiates the reward
        reward = f"rewards=[{{name: '{DIFFERENTIABLE[family]}'}}]"
    if algorithm == "euphonium":  # its process reward's gradient guides the sampler
        extra = [f"algorithm.process_reward={DIFFERENTIABLE[family]}"]
    common = ["sampler.num_steps=4", "train.prompts_per_iter=2", f"log.output_dir={tmp_path}", "log.sample_every=0",
              "log.save_every=0", reward, "train.clip_range=1e-2"]
    if algorithm == "on_policy_distillation":  # the teacher: a checkpoint of this family's model
        teacher = Trainer(family_cfg(family, *common, "log.run_name=teacher"))
        extra = [f"algorithm.teacher={teacher.save(0)}"]
    cfg = family_cfg(family, f"algorithm.name={algorithm}", *ALGORITHMS[algorithm], *common, "log.run_name=t", *extra)
    row = Trainer(cfg).iteration(0)
    assert row["optimizer_steps"] >= 1 and row["nfe_train"] > 0
    assert row["trained_edges"] > 0 or algorithm in NO_EDGES
    if algorithm in NO_RATIO:  # no statistic it did not measure (they read 0 and 1 before)
        assert not RATIO_STATISTICS & set(row), RATIO_STATISTICS & set(row)
    else:
        assert row["ratio_max_abs_dev_first_update"] < 1e-5


def trained_lora_velocities(tmp_path, cfg, sigma, **load_kwargs):
    """Train two LoRA iterations, load the saved file into a fresh pipeline with its ``load_lora_weights``
    (``load_kwargs`` passed on); the velocities (ours, the loaded pipeline's, the base model's) at ``sigma``."""
    import diffusers

    from flowrl.trainer import Trainer

    trainer = Trainer(cfg)
    run = trainer.train()
    ours = trainer.adapter
    fresh = load_adapter(cfg.model)  # the same base weights (seeded tiny init), no LoRA
    assert isinstance(fresh.pipe, getattr(diffusers, ours.pipeline_class_name))
    saved = str(run / "checkpoints" / "iter_00001")
    if hasattr(fresh.pipe, "load_lora_weights"):
        fresh.pipe.load_lora_weights(saved, **load_kwargs)
    else:  # a pipeline without a LoRA loader (HunyuanVideo 1.5): its transformer's own
        fresh.pipe.transformer.load_lora_adapter(saved, prefix="transformer", use_safetensors=True, **load_kwargs)
    x = torch.randn((len(sigma), *ours.latent_shape(cfg.model.resolution)), generator=torch.Generator().manual_seed(0))
    prompts = prompts_of(ours)[: len(sigma)]
    cond = ours.encode_prompts(prompts)
    with torch.no_grad():
        ours.transformer.eval()
        v_ours = ours.velocity(x, sigma, cond)
        v_pipe = fresh.velocity(x, sigma, fresh.encode_prompts(prompts))
        v_base = load_adapter(cfg.model).velocity(x, sigma, cond)
    return v_ours, v_pipe, v_base


@pytest.mark.parametrize("family", FAMILIES_SD3_QUICK)
def test_saved_lora_loads_with_the_family_pipeline(tmp_path, family):
    """Train two iterations with LoRA, save, load the file with the family's diffusers pipeline
    (``load_lora_weights``): its transformer gives our policy's velocity."""
    cfg = family_cfg(family, "sampler.num_steps=3", "train.prompts_per_iter=1", "algorithm.group_size=2",
                     "train.iterations=2", "train.lr=5e-2", f"log.output_dir={tmp_path}", "log.run_name=l",
                     "log.sample_every=0", REWARD[family])
    v_ours, v_pipe, v_base = trained_lora_velocities(tmp_path, cfg, torch.tensor([0.9, 0.4]))
    assert (v_ours - v_base).abs().max() > 1e-4  # the LoRA moved the policy
    assert torch.allclose(v_pipe, v_ours, atol=1e-5), (v_pipe - v_ours).abs().max()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_text_encoders_on_the_cpu_and_vae_tiling(family):
    """model.text_encoder_device=cpu keeps the encoders off the accelerator (embeddings unchanged, cached on the
    model's device); model.vae_tiling switches diffusers' VAE slicing and tiling on."""
    base = load_adapter(family_cfg(family).model)
    cfg = family_cfg(family, "model.text_encoder_device=cpu", "model.vae_tiling=true")
    ad = load_adapter(cfg.model)
    assert ad.text_device == torch.device("cpu") and ad.pipe.text_encoder.device == torch.device("cpu")
    assert ad.vae is None or (ad.vae.use_tiling and ad.vae.use_slicing)
    a, b = base.encode_prompts(prompts_of(family)), ad.encode_prompts(prompts_of(family))
    assert torch.equal(a.embeds, b.embeds) and torch.equal(a.pooled, b.pooled)


def test_sd3_rollout_equals_sd3_pipeline():
    """Noise off, CFG on: StableDiffusion3Pipeline's images from the tiny latent-space (VAE) SD3 model."""
    cfg = load_config(None, ["model.family=sd3", "model.resolution=16", "model.tiny.vae=true", "log.progress=false",
                             "sampler.guidance_scale=3.0"])
    adapter = load_adapter(cfg.model)
    shape = adapter.latent_shape(16)
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(3))[None]
    with torch.no_grad():
        ours = Sampler(cfg, adapter, num_steps=4)([PROMPTS[0]], [3])
    ref = adapter.pipe(prompt=[PROMPTS[0]], negative_prompt=[""], guidance_scale=3.0, height=16, width=16,
                       num_inference_steps=4, latents=noise, output_type="pt", max_sequence_length=0).images
    assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()


@pytest.mark.parametrize("family", FAMILIES_SD3_QUICK)
def test_bench_runs_on_every_family(family, capsys):
    import json

    from flowrl.cli import main

    assert main(["bench", *FAMILIES[family], "sampler.num_steps=2", "train.prompts_per_iter=1",
                 "algorithm.group_size=2", REWARD[family]]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["nfe_rollout_per_leaf"] == 2.0 and out["rollout_batched"]["transformer_calls"] == 2


def test_an_image_reward_on_videos_says_how_to_wrap_it(tmp_path, capsys):
    from flowrl.cli import main

    code = main(["train", *FAMILIES["wan"], "sampler.num_steps=2", "train.prompts_per_iter=1", "algorithm.group_size=2",
                 f"log.output_dir={tmp_path}", "log.progress=false", "rewards=[{name: jpeg_compressibility}]"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1] == ("flowrl: error: reward 'jpeg_compressibility' scores images (N, 3, H, W) but "
                                     "this model makes videos (N, F, 3, H, W); score its frames with "
                                     "rewards=[{name: video_frames, args: {reward: jpeg_compressibility}}]")


@pytest.mark.parametrize("family", ["flux", "flux2", "qwenimage", "wan", "zimage", "hunyuanvideo15", "ltx2"])
def test_a_local_diffusers_folder_loads_by_path(tmp_path, family):
    """model.pretrained=<folder>: a checkpoint saved with save_pretrained loads through the family's pipeline
    (FLUX.2: the class named in its model_index.json) and gives the same velocities."""
    cfg = family_cfg(family)
    tiny = load_adapter(cfg.model)
    tiny.pipe.save_pretrained(str(tmp_path / "ckpt"))
    extra = ["model.tiny.max_tokens=16"] if family != "qwenimage" else []
    loaded = load_adapter(family_cfg(family, f"model.pretrained={tmp_path / 'ckpt'}", "model.max_sequence_length=16"
                                     if family != "qwenimage" else "model.max_sequence_length=256", *extra).model)
    if family == "flux2":  # a real checkpoint's text layers are the pipeline's default; the tiny one has 2
        loaded.text_encoder_out_layers = tiny.text_encoder_out_layers
    if family == "hunyuanvideo15":  # the tiny pipeline's shortened chat template and text lengths are not saved
        for name in ("system_message", "prompt_template_encode_start_idx", "tokenizer_max_length",
                     "tokenizer_2_max_length", "vision_num_semantic_tokens"):
            setattr(loaded.pipe, name, getattr(tiny.pipe, name))
    x = torch.randn((1, *tiny.latent_shape(32)), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = tiny.velocity(x, torch.tensor([0.7]), tiny.encode_prompts(PROMPTS[:1]))
        b = loaded.velocity(x, torch.tensor([0.7]), loaded.encode_prompts(PROMPTS[:1]))
    assert type(loaded.pipe) is type(tiny.pipe) and torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
