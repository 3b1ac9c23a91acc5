"""``flowrl bench-gpu``: SD3.5-Medium- and FLUX.1-sized transformers with random weights built from the real
architecture configs (nothing is downloaded), timed on one accelerator:

- a LoRA GRPO update step in bf16 autocast (fp32 trainable weights, the per-edge Flow-SDE objective of
  :func:`flowrl.losses.edge_objective`), with fused AdamW, ``torch.compile`` of the blocks and gradient
  checkpointing toggled;
- a flat rollout (G independent chains) and a BranchGRPO tree rollout through :func:`flowrl.engine.rollout`;

at 512 and 1024 px. Each line prints step time, images/s, achieved TFLOP/s and MFU. The FLOP count is measured,
not assumed: ``torch.utils.flop_counter.FlopCounterMode`` counts the matmuls and attention of one step (forward
and backward), and MFU divides the achieved rate by the device's dense bf16 peak (``--peak-tflops``; H100/H200
SXM: 989). ``--tiny`` shrinks every model so that the same code runs on a CPU (the test suite does).
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass

import torch

from .models.published import (FLUX1_DEV, FLUX2_KLEIN_4B, HUNYUANVIDEO15_480P, LTX2_19B,  # published configs
                               QWEN_IMAGE, SD35_MEDIUM, WAN21_1_3B, WAN21_14B, ZIMAGE_6B)
from .errors import ConfigError
from .models.common import PromptEmbeds
from .sampling import peak_memory_mb, synchronize

TINY = {"sd35m": dict(SD35_MEDIUM, num_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                      caption_projection_dim=32, pooled_projection_dim=16, pos_embed_max_size=64,
                      dual_attention_layers=(0,)),
        "flux1": dict(FLUX1_DEV, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                      joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))}
TINY.update({"qwen": dict(QWEN_IMAGE, num_layers=1, num_attention_heads=2, attention_head_dim=32,
                          joint_attention_dim=32, axes_dims_rope=(8, 12, 12)),
             "wan13": dict(WAN21_1_3B, num_layers=1, num_attention_heads=2, attention_head_dim=32, ffn_dim=64,
                           text_dim=32, freq_dim=32),
             "flux2k": dict(FLUX2_KLEIN_4B, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                            num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 4, 4, 4))})
TINY["wan14"] = TINY["wan13"]
TINY["zimage"] = dict(ZIMAGE_6B, dim=64, n_layers=1, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=32,
                      axes_dims=[8, 12, 12])
TINY["hv15"] = dict(HUNYUANVIDEO15_480P, num_attention_heads=2, attention_head_dim=16, num_layers=1,
                    num_refiner_layers=1, text_embed_dim=32, text_embed_2_dim=16, image_embed_dim=16,
                    rope_axes_dim=(4, 6, 6))
TINY["ltx2"] = dict(LTX2_19B, in_channels=8, out_channels=8, audio_in_channels=8, audio_out_channels=8,
                    num_attention_heads=2, attention_head_dim=16, cross_attention_dim=32, audio_num_attention_heads=2,
                    audio_attention_head_dim=8, audio_cross_attention_dim=16, num_layers=1, caption_channels=32)
REAL = {"sd35m": SD35_MEDIUM, "flux1": FLUX1_DEV, "qwen": QWEN_IMAGE, "wan13": WAN21_1_3B, "wan14": WAN21_14B,
        "flux2k": FLUX2_KLEIN_4B, "zimage": ZIMAGE_6B, "hv15": HUNYUANVIDEO15_480P, "ltx2": LTX2_19B}
CLASSES = {"sd35m": "SD3Transformer2DModel", "flux1": "FluxTransformer2DModel", "qwen": "QwenImageTransformer2DModel",
           "wan13": "WanTransformer3DModel", "wan14": "WanTransformer3DModel", "flux2k": "Flux2Transformer2DModel",
           "zimage": "ZImageTransformer2DModel", "hv15": "HunyuanVideo15Transformer3DModel",
           "ltx2": "LTX2VideoTransformer3DModel"}
# families called through their adapter's transformer call
ADAPTER_FAMILY = {"qwen": "qwenimage", "wan13": "wan", "wan14": "wan", "flux2k": "flux2", "zimage": "zimage",
                  "hv15": "hunyuanvideo15", "ltx2": "ltx2"}
# CLIP 77 x 2 padded + T5 256 (SD3); T5 512 (FLUX.1-dev); a typical Qwen2.5-VL prompt; UMT5 padded to 512 (Wan);
# Qwen3 padded to 512 (FLUX.2 klein); a typical prompt's real Qwen3 tokens (Z-Image drops the padding)
# HunyuanVideo 1.5: Qwen2.5-VL padded to 1000 plus ByT5's 256 (here all through the first stream's refiner; the
# 729 masked vision tokens come from its adapter call); LTX-2: Gemma 3 padded to 1024, through the connectors
TEXT_TOKENS = {"sd35m": 333, "flux1": 512, "qwen": 256, "wan13": 512, "wan14": 512, "flux2k": 512, "zimage": 128,
               "hv15": 1256, "ltx2": 1024}
WAN_FRAMES = 9  # 3 latent frames (the 4x temporal VAE); LTX-2: 2 latent frames (8x) and 9 latent audio frames
LORA_TARGETS = {"sd35m": ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"],
                "flux1": ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"],
                "qwen": ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"],
                "wan13": ["attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0"],
                "wan14": ["attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0"],
                "flux2k": ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.to_qkv_mlp_proj"],
                "zimage": ["attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0"],
                "hv15": ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"],
                "ltx2": ["attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0"]}


@dataclass
class _Frames:
    """The two ``model`` settings a video family's latent shape reads."""
    resolution: int
    num_frames: int


@dataclass
class BenchModel:
    """A transformer with a ``velocity`` of the adapter protocol's shape (what the engine calls)."""
    family: str
    transformer: torch.nn.Module
    device: torch.device
    dtype: torch.dtype
    _shell: object = None  # Qwen-Image, Wan: the family adapter's transformer call, built on first use

    def latent_shape(self, px: int) -> tuple[int, ...]:
        if self.family in ("wan13", "wan14"):  # (C, latent frames, h, w)
            return (16, (WAN_FRAMES - 1) // 4 + 1, px // 8, px // 8)
        if self.family == "hv15":  # 32 channels, 4x temporal and 16x spatial compression
            return (32, (WAN_FRAMES - 1) // 4 + 1, px // 16, px // 16)
        if self.family == "ltx2":  # packed video tokens then audio tokens (S_v + S_a, C)
            from .models.ltx2 import LTX2Adapter

            return LTX2Adapter.memory_latent_shape(_Frames(px, WAN_FRAMES), dict(self.transformer.config))
        if self.family == "flux2k":  # (4C, h, w): the 32-channel VAE at 8x, patchified 2x2 before the transformer
            return (self.transformer.config.in_channels, px // 16, px // 16)
        return (16, px // 8, px // 8)  # a 16-channel VAE at 8x

    def velocity(self, x, sigma, cond: PromptEmbeds, guidance_scale: float = 1.0, negative=None):
        tr = self.transformer
        if self.family in ADAPTER_FAMILY:  # the family adapter's own transformer call, without a pipeline
            from .models import ADAPTERS

            if self._shell is None:
                self._shell = ADAPTERS[ADAPTER_FAMILY[self.family]].bare(tr, self.dtype, self.device,
                                                                         num_frames=WAN_FRAMES)
            with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
                return self._shell._forward(x, sigma, cond).float()
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            if self.family == "sd35m":
                out = tr(hidden_states=x, encoder_hidden_states=cond.embeds, pooled_projections=cond.pooled,
                         timestep=sigma * 1000, return_dict=False)[0]
                return out.float()
            b, c, h, w = x.shape  # FLUX packs 2x2 latent patches into 64-channel tokens
            tokens = x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w // 4, c * 4)
            ids = torch.zeros(h // 2, w // 2, 3, device=x.device)
            ids[..., 1] = torch.arange(h // 2, device=x.device)[:, None]
            ids[..., 2] = torch.arange(w // 2, device=x.device)[None, :]
            out = tr(hidden_states=tokens, encoder_hidden_states=cond.embeds, pooled_projections=cond.pooled,
                     timestep=sigma, img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(cond.embeds.shape[1], 3, device=x.device),
                     guidance=torch.full((b,), 3.5, device=x.device), return_dict=False)[0]
            return out.float().view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)


def build(family: str, device: torch.device, tiny: bool, lora_rank: int = 32) -> BenchModel:
    import diffusers
    from peft import LoraConfig

    cfg = (TINY if tiny else REAL)[family]
    cls = getattr(diffusers, CLASSES[family])
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    from .models.published import built_on

    with built_on(device, dtype):  # allocated in bf16 on the accelerator (an fp32 build of Qwen-Image takes 76 GiB)
        tr = cls(**cfg).to(dtype)  # frozen base weights in bf16
    tr.requires_grad_(False)
    tr.add_adapter(LoraConfig(r=lora_rank, lora_alpha=lora_rank, init_lora_weights="gaussian",
                              target_modules=LORA_TARGETS[family]))
    for p in tr.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # trainable weights in fp32, as the trainer keeps them
    return BenchModel(family, tr, device, dtype)


def _cond(model: BenchModel, n: int, tiny: bool) -> PromptEmbeds:
    tr = model.transformer.config
    tokens = 16 if tiny else TEXT_TOKENS[model.family]
    g = torch.Generator().manual_seed(0)
    from .models import ADAPTERS

    text_dim = ADAPTERS[ADAPTER_FAMILY.get(model.family, "sd3")].memory_text_dim(tr)  # each family's text width
    embeds = torch.randn(n, tokens, text_dim, generator=g).to(model.device)
    pooled = torch.randn(n, tr.get("pooled_projection_dim") or 0, generator=g).to(model.device)
    return PromptEmbeds(embeds, pooled)


# Measured on one H100 80GB with `flowrl bench-gpu` (docs/benchmarks.md, "GPU: every family on one H100"): MFU of
# the LoRA update without and with gradient checkpointing, and of a flat rollout (its NFE x the forward's counted
# FLOPs over its seconds), against 989 TFLOP/s. `flowrl gpu-check --plan` predicts each stage's time from them (a
# family not measured there takes the median of the measured ones)
MEASURED_H100_MFU = {  # family: (update, update with checkpointing, rollout)
    ("sd35m", 512): (0.135, 0.070, 0.20), ("sd35m", 1024): (0.229, 0.164, 0.24), ("flux1", 512): (0.296, 0.205, 0.33),
    ("flux2k", 512): (0.299, 0.210, 0.33), ("qwen", 512): (0.230, 0.137, 0.29), ("wan13", 256): (0.143, 0.074, 0.26)}
# the family and size with the largest forward of the benchmark's image families (FLUX.1-dev at 512 px, 21.5 TFLOP a
# row): the plan's stand-in for a forward the meta device cannot count
LARGEST_FORWARD = ("flux1", 512)
UPDATE_REPEATS = 2  # timed update steps after the warm-up (flowrl gpu-check --plan predicts a stage's time by it)


def update_step(model: BenchModel, px: int, batch: int, tiny: bool, *, fused_adamw: bool, checkpointing: bool,
                repeats: int = UPDATE_REPEATS, count_flops: bool = True) -> dict:
    """One LoRA GRPO update on ``batch`` edges at ``px``: forward, per-edge objective, backward, AdamW step, timed
    over ``repeats`` steps after a warm-up. Its FLOPs are counted on a one-edge step without gradient checkpointing
    (MFU does not credit recomputation) times ``batch`` (every edge has the same tokens), so the count never holds
    more activations than the measured step does; ``repeats=0`` returns the count alone."""
    dev, tr = model.device, model.transformer
    params = [p for p in tr.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, fused=fused_adamw and dev.type == "cuda")
    flops = 0
    if count_flops:  # the counter's dispatch mode is kept out of compiled code
        tr.disable_gradient_checkpointing()
        edges = flop_count_edges(batch)
        flops = batch // edges * _count_flops(_update_closure(model, px, edges, tiny, opt))
    if repeats == 0:  # the count alone
        return {"flops": flops}
    one = _update_closure(model, px, batch, tiny, opt)
    if checkpointing:
        tr.enable_gradient_checkpointing()
    else:
        tr.disable_gradient_checkpointing()
    one()  # warm-up (and compilation, where the blocks are compiled)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(repeats):
        one()
    synchronize(dev)
    seconds = (time.perf_counter() - t0) / repeats
    del opt
    return {"seconds": seconds, "flops": flops, "images_per_s": batch / seconds, "peak_memory_mb": peak_memory_mb(dev)}


def flop_count_edges(batch: int) -> int:
    """Edges in the step whose FLOPs are counted for an update of ``batch`` edges: one (every edge has the same
    tokens, so the count scales by the batch), never a full batch without checkpointing, which would hold more
    activations than the timed step. ``flowrl gpu-check --plan`` sizes the counting step by this rule."""
    return 1


def _update_closure(model: BenchModel, px: int, batch: int, tiny: bool, opt):
    """One update step on ``batch`` edges (inputs drawn once), as a function."""
    from .losses import edge_objective
    from .samplers.kernels import step as kernel_step

    dev = model.device
    g = torch.Generator().manual_seed(1)
    shape = (batch, *model.latent_shape(px))
    x = torch.randn(shape, generator=g).to(dev)
    sigma = torch.full((batch,), 0.7, device=dev)
    s_next = torch.full((batch,), 0.65, device=dev)
    cond = _cond(model, batch, tiny)
    with torch.no_grad():
        v0 = model.velocity(x, sigma, cond)
        out = kernel_step("flow_grpo", x, v0, sigma, s_next, noise_level=0.7, sigma_at_one=0.98,
                          noise=torch.randn(shape, generator=g).to(dev))
    adv = torch.randn(batch, generator=g).to(dev)

    def one():
        opt.zero_grad(set_to_none=True)
        v = model.velocity(x, sigma, cond)
        loss, *_ = edge_objective(x, v, sigma, s_next, out.sample, out.log_prob, adv, None, kernel="flow_grpo",
                                  noise_level=0.7, sigma_at_one=0.98, clip_range=1e-4)
        loss.mean().backward()
        opt.step()

    return one


def _count_flops(fn) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def forward_flops_per_row(model: BenchModel, px: int, tiny: bool) -> int:
    """The FLOPs of one transformer call on one latent (a call's count is linear in its rows: every row has the
    same tokens), counted by PyTorch's FLOP counter."""
    x = torch.zeros(1, *model.latent_shape(px), device=model.device)
    with torch.no_grad():
        return _count_flops(lambda: model.velocity(x, torch.full((1,), 0.5, device=model.device), _cond(model, 1, tiny)))


def rollout_plan(tree: bool, steps: int, chains: int):
    """A flat rollout (``chains`` independent chains per prompt) or a BranchGRPO tree with as many leaves (branch 2
    at every third step from the first, as many times as doubling reaches ``chains``; ``chains`` a power of 2)."""
    from .samplers.plans import RolloutPlan, StepSpec

    if not tree:
        return RolloutPlan([StepSpec(trained=True) for _ in range(steps)], roots_per_prompt=chains)
    splits = {3 * k for k in range(max(chains.bit_length() - 1, 0))}
    if max(splits, default=0) >= steps:
        raise ValueError(f"a tree of {chains} leaves branches at steps {sorted(splits)}: give more than "
                         f"{max(splits)} steps")
    return RolloutPlan([StepSpec(branch=2 if i in splits else 1, trained=True, sibling_noise="correlated")
                        for i in range(steps)])


def rollout_time(model: BenchModel, px: int, prompts: int, tiny: bool, tree: bool, steps: int = 20,
                 chains: int = 16) -> dict:
    """A flat rollout or a BranchGRPO tree (:func:`rollout_plan`) through the engine, bf16 autocast, noise drawn
    on the device, timed after a two-step warm-up of the same plan kind."""
    from .engine import rollout

    cond = _cond(model, prompts, tiny)
    dev = model.device
    gen = torch.Generator(dev).manual_seed(0)

    def one(n_steps):
        plan = rollout_plan(tree and n_steps == steps, n_steps, chains)
        with torch.no_grad():
            return rollout(model, cond, plan, torch.linspace(1, 0, n_steps + 1), model.latent_shape(px),
                           kernel="dance", noise_level=0.3, generator=gen, max_batch=64)

    one(2)  # warm-up: kernels, allocator, cuBLAS handles
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    synchronize(dev)
    t0 = time.perf_counter()
    t = one(steps)
    synchronize(dev)
    seconds = time.perf_counter() - t0
    leaves = int(t.leaf_group.numel())
    return {"seconds": seconds, "nfe": t.nfe, "transformer_calls": t.transformer_calls, "leaves": leaves,
            "images_per_s": leaves / seconds, "peak_memory_mb": peak_memory_mb(dev)}


# the shipped preset whose memory model sizes each family's micro-batch (train.micro_batch=auto)
PRESETS = {"sd35m": "sd35m_flow_grpo.yaml", "flux1": "flux1_dev_flow_grpo.yaml", "flux2k": "flux2_klein_flow_grpo.yaml",
           "qwen": "qwen_image_flow_grpo.yaml", "wan13": "wan21_1.3b_flow_grpo.yaml", "wan14": "wan21_14b_flow_grpo.yaml",
           "zimage": "zimage_turbo_flow_grpo.yaml", "hv15": "hunyuanvideo15_480p_flow_grpo.yaml",
           "ltx2": "ltx2_flow_grpo.yaml"}


H100_BYTES = 79 * 2 ** 30  # what an 80 GB H100 reports: the card --tiny sizes its micro-batches for


@functools.lru_cache(maxsize=None)
def auto_batch(family: str, px: int, device: torch.device, checkpointing: bool, most: int,
               capacity: int | None = None) -> tuple[int, dict]:
    """The update's micro-batch that ``train.micro_batch=auto`` chooses for the family's preset at ``px`` (bf16, no
    CFG in the update, the bench's LoRA targets) on ``device`` (or a card of ``capacity`` bytes), at most ``most``:
    (batch, the estimate's numbers)."""
    from .config import load_config
    from .memory import auto_micro_batch

    overrides = [f"model.resolution={px}", "train.micro_batch=auto", "train.mixed_precision=bf16",
                 "sampler.guidance_scale=1.0", f"train.gradient_checkpointing={str(checkpointing).lower()}",
                 "train.kl_beta=0", "train.ema.enabled=false",
                 "train.lora.targets=[" + ",".join(LORA_TARGETS[family]) + "]", "train.lora.rank=32"]
    if family in ("wan13", "wan14", "hv15", "ltx2"):
        overrides.append(f"model.num_frames={WAN_FRAMES}")
    cfg = load_config(PRESETS[family], overrides)  # the shipped preset, found from any folder
    chosen, why = auto_micro_batch(cfg, device, 1, capacity=capacity)
    return min(chosen, most), why


def run_gpu_bench(families=("sd35m", "flux1"), resolutions=(512, 1024), batch: int | str = 4, prompts: int = 2,
                  peak_tflops: float | None = None, tiny: bool = False, device: str | None = None, emit=print,
                  compiled: bool = True, attention_backend: str = "native", steps: int = 20, chains: int = 16,
                  cases: tuple[str, ...] = ("update", "update unfused-adamw", "update checkpointing"),
                  most_batch: int | dict[str, int] = 32) -> list[dict]:
    """Every case of every family, each row passed to ``emit`` (as one JSON line) as soon as it is measured; the
    attention kernels those of ``train.attention_backend`` (:mod:`flowrl.attention`). ``resolutions`` per family: a
    tuple, or a dict family -> tuple; ``steps`` and ``chains`` likewise (dicts keyed by (family, px)).
    ``batch="auto"``: each update case at the micro-batch ``train.micro_batch=auto`` picks (at most ``most_batch``,
    or its entry for the case where it is a dict)."""
    from .attention import attention_kernels

    with attention_kernels(attention_backend):
        return _run_gpu_bench(families, resolutions, batch, prompts, peak_tflops, tiny, device, emit, compiled,
                              steps, chains, cases, most_batch)


def _per(value, *key):
    if isinstance(value, dict):
        return value[key if len(key) > 1 else key[0]]
    return value


UPDATE_CASES = {"update": (True, False), "update unfused-adamw": (False, False), "update checkpointing": (True, True)}


def _run_gpu_bench(families, resolutions, batch, prompts, peak_tflops, tiny, device, emit, compiled, steps, chains,
                   cases, most_batch) -> list[dict]:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    from .throughput import device_peak_tflops

    # the named device's dense bf16 peak (H100 SXM 989, PCIe 756, NVL 835, H200 989, A100 312), or the given one;
    # a CPU has none: its rows' MFU is against 1 TFLOP/s, named as such in every row
    peak_tflops = device_peak_tflops(dev, peak_tflops) or 1.0
    rows = []

    def emit_row(row):
        rows.append(row)
        emit(json.dumps(row))

    for family in families:
        sizes = _per(resolutions, family)
        if tiny:
            sizes = tuple(min(r, 64) for r in sizes)
        model = build(family, dev, tiny)
        for px in sizes:
            for name in cases:
                fused, ckpt = UPDATE_CASES[name]
                try:
                    most = most_batch[name] if isinstance(most_batch, dict) else most_batch
                    n, why = (auto_batch(family, px, dev, ckpt, most, H100_BYTES if tiny else None)
                              if batch == "auto" else (batch, None))
                except ConfigError as exc:  # not even one edge fits this card: say so, measure the rest
                    emit_row({"family": family, "px": px, "case": name, "skipped": str(exc)})
                    continue
                r = update_step(model, px, n, tiny, fused_adamw=fused, checkpointing=ckpt)
                row = _update_row(family, px, name, n, r, r["flops"], peak_tflops)
                if why is not None:  # the memory model's prediction for this micro-batch, beside the measured peak
                    row["estimate_mb"] = round((why["state_gib"] + n * why["activations_per_input_gib"]) * 1024, 1)
                emit_row(row)
            per_row = forward_flops_per_row(model, px, tiny)
            for tree in (False, True):
                r = rollout_time(model, px, prompts, tiny, tree, _per(steps, family, px), _per(chains, family, px))
                tflops = per_row * r["nfe"] / r["seconds"] / 1e12
                emit_row({"family": family, "px": px, "case": "rollout tree" if tree else "rollout flat",
                          "seconds": round(r["seconds"], 4), "images_per_s": round(r["images_per_s"], 2),
                          "nfe": r["nfe"], "transformer_calls": r["transformer_calls"], "leaves": r["leaves"],
                          "gflop_per_nfe": round(per_row / 1e9, 4), "achieved_tflops": round(tflops, 3),
                          "mfu": round(tflops / peak_tflops, 4), "peak_tflops": peak_tflops,
                          "peak_memory_mb": round(r["peak_memory_mb"], 1)})
        if compiled:  # last: the blocks stay compiled; each step's FLOPs counted on the eager model first
            from .policy import configure_update_path

            counted = []
            for px in sizes:
                most = most_batch["update"] if isinstance(most_batch, dict) else most_batch
                n = batch if batch != "auto" else auto_batch(family, px, dev, False, most,
                                                             H100_BYTES if tiny else None)[0]
                counted.append((px, n, update_step(model, px, n, tiny, fused_adamw=True, checkpointing=False,
                                                   repeats=0)["flops"]))
            configure_update_path(model.transformer, _Opts(compile_transformer=True))
            for px, n, flops in counted:
                r = update_step(model, px, n, tiny, fused_adamw=True, checkpointing=False, count_flops=False)
                emit_row(_update_row(family, px, "update compiled", n, r, flops, peak_tflops))
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _update_row(family, px, case, batch, r, flops, peak_tflops) -> dict:
    tflops = flops / r["seconds"] / 1e12
    return {"family": family, "px": px, "case": case, "batch": batch, "seconds": round(r["seconds"], 4),
            "images_per_s": round(r["images_per_s"], 2), "gflop_per_step": round(flops / 1e9, 4),
            "achieved_tflops": round(tflops, 3), "mfu": round(tflops / peak_tflops, 4), "peak_tflops": peak_tflops,
            "peak_memory_mb": round(r["peak_memory_mb"], 1)}


@dataclass
class _Opts:
    """The ``train`` fields :func:`flowrl.policy.configure_update_path` reads."""
    gradient_checkpointing: bool = False
    attention_backend: str = "native"
    compile_transformer: bool = False
