"""What every diffusers-pipeline adapter shares: frozen encoders, the per-prompt embedding cache, true CFG by
batch doubling, VAE decoding, the LoRA-off reference policy, LoRA saving in the family's format and the
family pipeline's own sigma schedule. A family adds its text encoding (:meth:`_encode_one`), its transformer
call (:meth:`_forward`) and its latent geometry."""

from __future__ import annotations

import math
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from ..errors import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# The attention projections of a joint (dual-stream) transformer block, as diffusers names them in SD3, FLUX and
# Qwen-Image: Flow-GRPO's SD3 LoRA targets (its released training scripts), which its FLUX and Qwen-Image scripts reuse.
JOINT_ATTENTION_LORA_TARGETS = [
    "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
    "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v",
]


@dataclass
class PromptEmbeds:
    embeds: torch.Tensor  # (N, L, D) text tokens (padded to the longest prompt where lengths differ)
    pooled: torch.Tensor  # (N, P) pooled projections (P = 0 for families without one)
    mask: torch.Tensor | None = None  # (N, L) 1 for real tokens; None when every prompt has L tokens
    # (N, K, C, h, w) an editing family's K source images as latents (its reference conditioning); None otherwise
    reference: torch.Tensor | None = None
    # a family's further per-prompt streams, each (N, ...) (HunyuanVideo 1.5's ByT5 glyph tokens and their mask)
    extra: dict[str, torch.Tensor] | None = None

    def index(self, idx: torch.Tensor) -> "PromptEmbeds":
        return PromptEmbeds(self.embeds[idx], self.pooled[idx], None if self.mask is None else self.mask[idx],
                            None if self.reference is None else self.reference[idx],
                            None if self.extra is None else {k: v[idx] for k, v in self.extra.items()})

    def padded(self, length: int) -> "PromptEmbeds":
        """The same rows zero-padded to ``length`` tokens, with the mask that marks the real ones."""
        n, cur = self.embeds.shape[:2]
        mask = self.mask if self.mask is not None else self.embeds.new_ones(n, cur, dtype=torch.long)
        return PromptEmbeds(torch.nn.functional.pad(self.embeds, (0, 0, 0, length - cur)), self.pooled,
                            torch.nn.functional.pad(mask, (0, length - cur)), self.reference, self.extra)


@dataclass(frozen=True)
class LoadMode:
    """How a model loads. Sharded training (train.fsdp) loads with ``sharded``: the transformer stays off the
    accelerator (it is sharded from the main process's copy), and with ``meta_transformer`` the other processes build
    it on the meta device, without weights, so that a 12-32B checkpoint is read into host memory once per machine's
    main process, not once per GPU."""

    sharded: bool = False
    meta_transformer: bool = False


# the load mode of the current context: set only inside sharded_loading, and restored when it ends (a context
# variable, so a load in another thread or task is not affected)
LOAD_MODE: ContextVar[LoadMode] = ContextVar("flowrl_load_mode", default=LoadMode())


@contextmanager
def sharded_loading(meta_transformer: bool):
    """Load models for sharding for the duration (see :class:`LoadMode`)."""
    token = LOAD_MODE.set(LoadMode(sharded=True, meta_transformer=meta_transformer))
    try:
        yield
    finally:
        LOAD_MODE.reset(token)


def meta_transformer(pipeline_class, source: str, dtype: torch.dtype):
    """The checkpoint's transformer built from its config on the meta device (no weights read)."""
    import diffusers

    _, class_name = pipeline_class.load_config(source)["transformer"]
    cls = getattr(diffusers, class_name)
    with torch.device("meta"):
        return cls.from_config(cls.load_config(source, subfolder="transformer")).to(dtype)


def load_pipeline(pipeline_class, source: str, dtype: torch.dtype, family: str, **kwargs):
    """A diffusers pipeline by hub id or local folder (downloads only where the hub is reachable)."""
    try:
        if LOAD_MODE.get().meta_transformer and "transformer" not in kwargs:
            kwargs["transformer"] = meta_transformer(pipeline_class, source, dtype)
        return pipeline_class.from_pretrained(source, torch_dtype=dtype, **kwargs)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"model.pretrained: cannot load {family} pipeline {source!r} ({first}); give a local "
                          "diffusers folder or a hub id reachable from this machine") from exc


class PipelineAdapter:
    family = "base"
    pipeline_class_name = ""  # the diffusers pipeline whose LoRA format and schedule this family uses
    lora_targets: list[str] = []
    text_encoder_names: tuple[str, ...] = ()
    variable_length = False  # prompts encode to different token counts (padded, with a mask)

    # ---------------------------------------------------------------- the family's facts, asked by core modules
    # (configuration checks, ``flowrl memory``, context parallelism, sharding, throughput): no core module names a
    # family, so a plug-in family declares its own here and gets its own answers
    transformer_class_name = ""  # the diffusers transformer class: its context-parallel plan, the memory replica
    # checkpoint id -> (its published transformer/config.json, transformers of that architecture it holds), so that
    # ``flowrl memory`` needs no download
    published_architectures: dict[str, tuple[dict, int]] = {}
    context_parallel_splits_text = False  # the context-parallel plan splits the text tokens as well as the image's
    context_parallel_refusal = ""  # why a family whose transformer has a diffusers plan has none in flowrl
    video = False  # latents carry a frame axis (C, F, H, W)

    # an editing family: each prompt is an edit request (flowrl.editing.EditPrompt) whose source images condition
    # the transformer; they travel beside the text embeddings (PromptEmbeds.reference)
    edits = False
    max_sources = 1  # source images per request the family's transformer takes
    resolution: int | None = None  # model.resolution (editing families): the size source images are resized to

    tiny_patch_pixels: int | None = None  # pixels per latent patch of the tiny model (None: model.tiny's patch x VAE)
    real_patch_pixels = 16  # a real checkpoint's: the VAE's 8 x 2 x 2 patches

    @classmethod
    def resolution_multiple(cls, model_cfg) -> int:
        """``model.resolution`` must be a multiple of this: the pixels per latent patch (VAE downsampling x the
        transformer's patch), ``tiny_patch_pixels`` / ``real_patch_pixels``."""
        if model_cfg.pretrained in (None, "", "tiny"):
            return cls.tiny_patch_pixels or model_cfg.tiny.patch_size * (2 if model_cfg.tiny.vae else 1)
        return cls.real_patch_pixels

    @classmethod
    def frames_multiple(cls, model_cfg) -> int | None:
        """``model.num_frames - 1`` must be a multiple of this (a video family's temporal compression); None: no
        rule is checked before loading."""
        return None

    @classmethod
    def memory_image_tokens(cls, shape: tuple[int, ...]) -> int:
        """Image tokens of a real checkpoint's latent of ``memory_latent_shape``: its cells in 2 x 2 patches."""
        return math.prod(shape[1:]) // 4

    @classmethod
    def fsdp_units(cls) -> tuple[str, ...]:
        """Class names of the transformer's modules that FSDP2 shards one at a time: the transformer class's
        ``_repeated_blocks`` (else ``_no_split_modules``); a family whose blocks are split otherwise overrides it."""
        import diffusers

        t = getattr(diffusers, cls.transformer_class_name, None)
        return tuple(getattr(t, "_repeated_blocks", None) or getattr(t, "_no_split_modules", None) or ())

    @classmethod
    def context_parallel_plan(cls) -> dict | None:
        """diffusers' context-parallel plan of this family's transformer (``_cp_plan``), or None without one. An
        editing family has none: its sequence carries the source's tokens after the image's, which the plan's
        split has not been tested with."""
        import diffusers

        if cls.edits:
            return None

        return getattr(getattr(diffusers, cls.transformer_class_name, None), "_cp_plan", None) or None

    @classmethod
    def memory_latent_shape(cls, model_cfg, config: dict) -> tuple[int, ...]:
        """The engine's latent shape at ``model.resolution`` for a real checkpoint whose transformer config is
        ``config`` (no weights loaded): here (C, H / 8, W / 8)."""
        r = model_cfg.resolution // 8
        return (config.get("in_channels", 16), r, r)

    @classmethod
    def memory_source_shape(cls, model_cfg, config: dict) -> tuple[int, ...]:
        """An editing family's source latent shape for a real checkpoint: here the output's."""
        return cls.memory_latent_shape(model_cfg, config)

    @classmethod
    def memory_heads(cls, config: dict) -> tuple[int, int]:
        """(attention heads, head width) of a transformer config, for ``flowrl memory``'s narrow replica."""
        return config["num_attention_heads"], config["attention_head_dim"]

    @classmethod
    def memory_block_counts(cls, config: dict) -> dict[str, int]:
        """The config keys counting repeated blocks and their values (the replica keeps one or two of each)."""
        return {k: config[k] for k in ("num_layers", "num_single_layers") if k in config}

    @classmethod
    def memory_narrow(cls, config: dict, heads: int, blocks: dict[str, int]) -> dict:
        """Config changes of a replica with ``heads`` attention heads and the given block counts (the widths that
        follow the heads scaled with them)."""
        full = config["num_attention_heads"]
        changes = {"num_attention_heads": heads, **blocks}
        if "ffn_dim" in config:
            changes["ffn_dim"] = max(1, config["ffn_dim"] * heads // full)
        if "caption_projection_dim" in config:  # SD3: the text stream's width is the model width
            changes["caption_projection_dim"] = heads * config["attention_head_dim"]
        if "dual_attention_layers" in config:
            changes["dual_attention_layers"] = tuple(i for i in config["dual_attention_layers"]
                                                     if i < blocks["num_layers"])
        return changes

    @classmethod
    def memory_text_dim(cls, config: dict) -> int:
        """The width of the text tokens the transformer takes."""
        return config.get("joint_attention_dim") or config.get("text_dim") or 4096

    @classmethod
    def memory_text_tokens(cls, model_cfg) -> int:
        """Text tokens per prompt a real checkpoint's transformer attends to."""
        return model_cfg.max_sequence_length

    def image_seq_len(self, resolution: int) -> int:
        """Image tokens per sample: the latent in 2 x 2 patches (a family with another patching overrides it)."""
        _, h, w = self.latent_shape(resolution)
        return (h // 2) * (w // 2)

    def patch_pixels(self, resolution: int) -> int:
        """Pixels per latent patch along a side of a square image: the period at which a patch-grid artifact shows
        (16 for SD3, FLUX and Qwen-Image at real size)."""
        return max(1, round(resolution / self.image_seq_len(resolution) ** 0.5))

    def extra_transformers(self) -> list[torch.nn.Module]:
        """Transformers besides the trained one that the rollout calls (frozen, held whole on every process)."""
        return []

    def pad_sigma(self) -> float:
        """A sigma at which a zero-weight padding call reaches the trained transformer."""
        return 0.5

    def __init__(self, pipe, max_sequence_length: int = 256, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, text_encoder_device: str = "same", vae_tiling: bool = False,
                 **family):
        for name, value in family.items():  # the family's own settings (guidance, frames, ...), class defaults
            if not hasattr(type(self), name):
                raise TypeError(f"{type(self).__name__} has no setting {name!r}")
            setattr(self, name, value)
        self.pipe = pipe
        self.transformer = pipe.transformer
        self.vae = pipe.vae
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_sequence_length = max_sequence_length
        self._cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        # each prompt is encoded once and cached, so the text encoders (T5-XXL: 9.5 GB in bf16) can live on the
        # CPU and leave the accelerator to the transformer
        self.text_device = self.device if text_encoder_device == "same" else torch.device(text_encoder_device)
        if LOAD_MODE.get().sharded:  # the transformer is sharded later, from the main process's copy
            for component in pipe.components.values():
                if isinstance(component, torch.nn.Module) and component is not pipe.transformer:
                    component.to(self.device)
        else:
            self.pipe.to(self.device)
        for name in (*self.text_encoder_names, "vae"):
            module = getattr(pipe, name, None)
            if module is not None:
                module.requires_grad_(False).eval()
                if name != "vae":
                    module.to(self.text_device)
        if vae_tiling and self.vae is not None:  # decode large images in tiles and one sample at a time
            self.vae.enable_slicing()
            self.vae.enable_tiling()
        if self.transformer.dtype != dtype:
            self.transformer.to(dtype=dtype)

    # ---------------------------------------------------------------- construction
    presets: dict[str, str] = {}  # short names -> hub ids
    tiny_builder = ""  # the function in flowrl.models.tiny that builds this family's tiny offline pipeline
    tiny_sequence_length = True  # the tiny model encodes model.tiny.max_tokens tokens (else model.max_sequence_length)

    @classmethod
    def build_tiny(cls, tiny) -> tuple[object, dict]:
        """(a tiny pipeline of this family from ``model.tiny``, extra constructor options)."""
        from . import tiny as tiny_models

        out = getattr(tiny_models, cls.tiny_builder)(tiny, seed=tiny.init_seed)
        return out if isinstance(out, tuple) else (out, {})

    @classmethod
    def bare(cls, transformer, dtype: torch.dtype, device: torch.device, **family) -> "PipelineAdapter":
        """This family's transformer call (:meth:`_forward`) around ``transformer``, without a pipeline (no
        encoders, no VAE): for benchmarks and memory estimates on random-weight or narrowed models. ``family``:
        the family's settings (``family_options``, e.g. ``num_frames``) where they differ from the class's."""
        shell = cls.__new__(cls)
        shell.transformer, shell.dtype, shell.device, shell.boundary = transformer, dtype, torch.device(device), None
        for name, value in family.items():
            if name in cls.family_options:
                setattr(shell, name, value)
        return shell

    family_options: tuple[str, ...] = ()  # settings read from the ``model`` config section of the same name

    @classmethod
    def options(cls, model_cfg) -> dict:
        """Family-specific constructor settings from ``model`` (guidance, frames, ...); an editing family also gets
        ``model.resolution``, the size its source images are resized to."""
        out = {name: getattr(model_cfg, name) for name in cls.family_options}
        if cls.edits:
            out["resolution"] = model_cfg.resolution
        return out

    @classmethod
    def from_config(cls, model_cfg, device="cpu"):
        """The tiny offline model (``pretrained: tiny``), or a checkpoint by short name, hub id or local folder."""
        import diffusers

        from ..registry import MODEL_NAMES

        dtype = DTYPES[model_cfg.dtype]
        extra = cls.options(model_cfg)
        if model_cfg.pretrained in (None, "", "tiny"):
            pipe, tiny_extra = cls.build_tiny(model_cfg.tiny)
            extra.update(tiny_extra)
            max_seq = model_cfg.tiny.max_tokens if cls.tiny_sequence_length else model_cfg.max_sequence_length
        elif model_cfg.pretrained in MODEL_NAMES:
            pipe = cls.embedded_pipeline(model_cfg)
            max_seq = pipe.embedded_max_tokens
        else:
            source = cls.presets.get(model_cfg.pretrained, model_cfg.pretrained)
            pipe = load_pipeline(getattr(diffusers, cls.pipeline_class_name), source, dtype, cls.family)
            max_seq = model_cfg.max_sequence_length
        return cls(pipe, max_sequence_length=max_seq, device=device, dtype=dtype,
                   text_encoder_device=model_cfg.text_encoder_device, vae_tiling=model_cfg.vae_tiling, **extra)

    @classmethod
    def embedded_pipeline(cls, model_cfg, loader=None):
        """An embedded model by registered name (or, with ``loader``, an exported folder read by it): it must be
        this family's pipeline, and it draws one geometry (``pipe.embedded_geometry``: config field -> value);
        otherwise one line says which field to change."""
        from ..registry import MODEL_NAMES

        name = model_cfg.pretrained
        pipe = loader(name) if loader is not None else MODEL_NAMES.resolve(name)(None)
        if type(pipe).__name__ != cls.pipeline_class_name:
            raise ConfigError(f"model.pretrained: {name} is a {type(pipe).__name__}, not a {cls.family} model; set "
                              "model.family to its family")
        for key, value in getattr(pipe, "embedded_geometry", {}).items():
            if getattr(model_cfg, key) != value:
                raise ConfigError(f"model.{key}: the {name} model was trained at {key}={value}; set model.{key}={value}")
        return pipe

    # ---------------------------------------------------------------- text
    def _encode_one(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(embeds (L, D), pooled (P,)) of one prompt."""
        raise NotImplementedError

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """Embeddings for each prompt, computed once per distinct string and cached."""
        # One prompt per call: batched matmuls can round differently with batch composition, and a prompt's
        # embedding must not depend on which other prompts happened to be encoded with it (exact resume).
        requests, keys = prompts, [self._text_key(p) for p in prompts]
        todo = {k: p for k, p in zip(keys, prompts) if k not in self._cache}
        for key in sorted(todo):
            embeds, pooled = self._encode_one(todo[key])
            self._cache[key] = (embeds.float().to(self.device), pooled.float().to(self.device))
        prompts = keys  # the cache's rows from here on
        pooled = torch.stack([self._cache[p][1] for p in prompts])
        reference = self.encode_sources(requests) if self.edits else None
        if not self.variable_length:
            return PromptEmbeds(torch.stack([self._cache[p][0] for p in prompts]), pooled, None, reference)
        rows = [PromptEmbeds(self._cache[p][0][None], pooled[k: k + 1]) for k, p in enumerate(prompts)]
        width = max(r.embeds.shape[1] for r in rows)  # (N, L_max, D) zero-padded, with its mask
        rows = [r.padded(width) for r in rows]
        return PromptEmbeds(torch.cat([r.embeds for r in rows]), pooled, torch.cat([r.mask for r in rows]), reference)

    # ---------------------------------------------------------------- source images (editing families)
    @torch.no_grad()
    def encode_sources(self, prompts: list[str]) -> torch.Tensor | None:
        """(N, K, C, h, w) the prompts' K source images as latents, each distinct set encoded once and cached; None
        when no prompt has a source (a negative prompt, which borrows its row's sources in :meth:`velocity`)."""
        from ..editing import load_source, sources_of

        keys = [sources_of(p) for p in prompts]
        if not any(keys):
            return None
        for p, k in zip(prompts, keys):
            if not k:
                raise ConfigError(f"model.family={self.family} edits images: prompt {str(p)!r} has no source image; "
                                  "give every data row a 'source' (an image path)")
            if len(k) > self.max_sources or len(k) != len(keys[0]):
                raise ConfigError(f"model.family={self.family}: every edit request needs the same number of source "
                                  f"images, at most {self.max_sources} (prompt {str(p)!r} has {len(k)})")
        cache = self.__dict__.setdefault("_source_cache", {})
        for k in sorted(set(keys) - set(cache)):
            images = [load_source(key, self.source_pixels()) for key in k]
            cache[k] = self._encode_source_images(images).float().to(self.device)
        return torch.stack([cache[k] for k in keys])

    text_reads_sources = False  # an editing family whose text encoder also reads the source images

    def _text_key(self, prompt: str):
        """The text cache's key: the instruction alone, unless the text encoder reads the sources too (an edit
        request's embedding then depends on them), so that an instruction over many sources is encoded once."""
        return prompt if self.text_reads_sources else str(prompt)

    def source_pixels(self) -> int:
        """Pixels per side a (square) source image is read at: ``model.resolution`` unless the family reads its
        sources at a size of its own."""
        return self.resolution

    def _encode_source_images(self, images: list) -> torch.Tensor:
        """(K, C, h, w) latents of K RGB PIL images of ``resolution`` pixels: the pipeline's image processor, then the
        VAE's mode, shifted and scaled as the family's editing pipeline does (a pixel-space model: the pixels)."""
        pixels = torch.cat([self.pipe.image_processor.preprocess(img, self.resolution, self.resolution)
                            for img in images])  # (K, 3, H, W) in [-1, 1]
        if self.pixel_space:  # a pixel-space model's latents are the pixels
            return pixels
        cfg = self.vae.config
        z = self.vae.encode(pixels.to(device=self.vae.device, dtype=self.vae.dtype)).latent_dist.mode()
        return (z - (cfg.shift_factor or 0.0)) * cfg.scaling_factor

    # ---------------------------------------------------------------- velocity
    def _forward(self, x: torch.Tensor, sigma: torch.Tensor, cond: PromptEmbeds) -> torch.Tensor:
        """The transformer's velocity for x (B, *latent) at sigma (B,), cond rows aligned with x; fp32 out."""
        raise NotImplementedError

    def _guide(self, v_neg: torch.Tensor, v_pos: torch.Tensor, guidance_scale: float) -> torch.Tensor:
        """True CFG's combination of the two velocities (B, *latent)."""
        return v_neg + guidance_scale * (v_pos - v_neg)

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: PromptEmbeds, guidance_scale: float = 1.0,
                 negative: PromptEmbeds | None = None, unconditional_grad: bool = True) -> torch.Tensor:
        """v(x, sigma | prompt) for a batch; x (B, *latent) fp32, sigma (B,), cond rows aligned with x.

        With ``guidance_scale > 1`` and a negative embedding the batch is doubled ``[neg; pos]`` (prompts of
        different token counts padded to one length, with masks) and combined by :meth:`_guide`; with
        ``unconditional_grad=False`` under autograd, the negative half is its own forward without a graph.
        Returns fp32 (B, *latent).
        """
        b = x.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).expand(b)
        use_cfg = guidance_scale > 1.0 and negative is not None
        if use_cfg:
            # an edit's negative half sees the same source images as its positive half (the editing pipelines' CFG)
            neg = PromptEmbeds(negative.embeds.expand(b, -1, -1), negative.pooled.expand(b, -1),
                               None if negative.mask is None else negative.mask.expand(b, -1), cond.reference,
                               None if negative.extra is None
                               else {k: v.expand(b, *v.shape[1:]) for k, v in negative.extra.items()})
            if neg.mask is not None or cond.mask is not None or neg.embeds.shape[1] != cond.embeds.shape[1]:
                width = max(neg.embeds.shape[1], cond.embeds.shape[1])
                neg, cond = neg.padded(width), cond.padded(width)
            if not unconditional_grad and torch.is_grad_enabled():  # the negative half is a constant
                with torch.no_grad():
                    v_neg = self._forward(x, sigma, neg)
                return self._guide(v_neg, self._forward(x, sigma, cond), guidance_scale)
            x = torch.cat([x, x])
            sigma = torch.cat([sigma, sigma])
            cond = PromptEmbeds(torch.cat([neg.embeds, cond.embeds]), torch.cat([neg.pooled, cond.pooled]),
                                None if cond.mask is None else torch.cat([neg.mask, cond.mask]),
                                None if cond.reference is None else torch.cat([cond.reference, cond.reference]),
                                None if cond.extra is None else {k: torch.cat([neg.extra[k], v])
                                                                 for k, v in cond.extra.items()})
        out = self._forward(x, sigma, cond)
        if use_cfg:
            v_neg, v_pos = out.chunk(2)
            out = self._guide(v_neg, v_pos, guidance_scale)
        return out

    # ---------------------------------------------------------------- geometry and schedule
    @property
    def pixel_space(self) -> bool:
        return self.vae is None

    def vae_factor(self) -> int:
        return 1 if self.pixel_space else 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def scheduler_config(self) -> dict:
        return dict(self.pipe.scheduler.config)

    def default_sigmas(self, num_steps: int, resolution: int) -> torch.Tensor:
        """The sigmas the family's diffusers pipeline uses (its scheduler's own grid, dynamic shift included)."""
        from ..samplers.schedules import diffusers_sigmas

        c = self.scheduler_config
        mu = self.shift_mu(num_steps, resolution) if c.get("use_dynamic_shifting", False) else None
        return diffusers_sigmas(c, num_steps, mu)

    def shift_mu(self, num_steps: int, resolution: int) -> float:
        """mu of the resolution-dependent time shift: linear in the token count (FLUX.1, Qwen-Image, SD3.5)."""
        from ..samplers.schedules import dynamic_shift_mu

        c = self.scheduler_config
        return dynamic_shift_mu(self.image_seq_len(resolution), c.get("base_image_seq_len", 256),
                                c.get("max_image_seq_len", 4096), c.get("base_shift", 0.5), c.get("max_shift", 1.15))

    def linspace_shifted_sigmas(self, num_steps: int, resolution: int) -> torch.Tensor:
        """FluxPipeline's, Flux2Pipeline's and QwenImagePipeline's grid: sigmas linspace(1, 1/T, T), shifted
        with :meth:`shift_mu`, then a final 0."""
        import numpy as np
        from diffusers import FlowMatchEulerDiscreteScheduler

        sched = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config)
        sched.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), device="cpu",
                            mu=self.shift_mu(num_steps, resolution))
        return sched.sigmas.detach().float().clone()

    # ---------------------------------------------------------------- images
    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents (B, C, h, w) -> images (B, 3, H, W) in [0, 1], fp32."""
        if self.pixel_space:
            return (latents.float() / 2 + 0.5).clamp(0, 1)
        cfg = self.vae.config
        z = latents / cfg.scaling_factor + (cfg.shift_factor or 0.0)
        image = self.vae.decode(z.to(self.vae.dtype), return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)

    # ---------------------------------------------------------------- LoRA
    def save_lora(self, directory, layers: dict, metadata: dict) -> None:
        """LoRA weights in the family's diffusers format (its pipeline's ``load_lora_weights`` reads them)."""
        import diffusers

        getattr(diffusers, self.pipeline_class_name).save_lora_weights(
            str(directory), transformer_lora_layers=layers, transformer_lora_adapter_metadata=metadata)

    @contextmanager
    def reference(self):
        """The reference policy: the same transformer with its LoRA adapters disabled."""
        if getattr(self.transformer, "_hf_peft_config_loaded", False):
            self.transformer.disable_adapters()
            try:
                yield
            finally:
                self.transformer.enable_adapters()
        else:
            raise RuntimeError("the LoRA-off reference needs LoRA; under full fine-tuning the policy keeps the reference "
                               "(Policy.reference: a frozen copy or the EMA, train.kl_reference)")
