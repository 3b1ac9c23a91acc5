"""``flowrl memory CONFIG``: how many bytes each process holds to train a config, without weights or a download.

- Weights, gradients, optimizer state, EMA, reference and old-policy copies are counted exactly from the
  architecture, built on the meta device (the published ``transformer/config.json`` of the shipped presets'
  checkpoints, a local folder's own config, or the tiny model), with LoRA added as the config asks. Trained
  weights are fp32 (mixed precision keeps fp32 masters), frozen ones in ``model.dtype``, AdamW holds two fp32
  moments; under ``train.fsdp`` everything sharded is divided by the shard group's size.
- Activations of the update are *measured*, not modelled: a narrow replica of the transformer (the same class with
  one or two of each repeated block and a few attention heads, at the config's real token counts) runs a forward
  with gradients, the bytes autograd saves are counted, and the per-block share is scaled by the width ratio, the
  number of blocks, the micro-batch (doubled by CFG where its unconditional half keeps a graph,
  ``train.cfg_unconditional_grad``) and bf16 autocast (x 0.5). The
  printed assumptions say exactly this; gradient checkpointing keeps one block's activations plus every block's
  input.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import ConfigError
from .randomness import keeps_generators

GIB = 2 ** 30

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass
class Architecture:
    class_name: str
    config: dict
    experts: int  # transformers of this architecture the model holds (two: one trained, one frozen)


def architecture(model_cfg) -> Architecture:
    """The transformer's class and config for ``model``: a checkpoint its family declares
    (``published_architectures``), a local diffusers folder, or the tiny and embedded models (built)."""
    from .registry import MODEL_NAMES, adapter_class

    family = adapter_class(model_cfg.family)
    name = model_cfg.pretrained
    source = family.presets.get(name, name) if name else name
    published = family.published_architectures
    if name in (None, "", "tiny") or name.startswith("tiny") or (name in MODEL_NAMES and source not in published):
        from .models import load_adapter

        adapter = load_adapter(model_cfg)
        return Architecture(type(adapter.transformer).__name__, dict(adapter.transformer.config),
                            1 + len(adapter.extra_transformers()))
    if source in published:
        config, experts = published[source]
        return Architecture(family.transformer_class_name, dict(config), experts)
    folder = Path(source) / "transformer"
    if (folder / "config.json").is_file():
        config = json.loads((folder / "config.json").read_text())
        experts = 2 if (Path(source) / "transformer_2" / "config.json").is_file() else 1
        return Architecture(config["_class_name"], {k: v for k, v in config.items() if not k.startswith("_")}, experts)
    known = ", ".join(sorted(published)) or "none"
    raise ConfigError(f"model.pretrained: no architecture config for {source!r} on this machine; give a local diffusers "
                      f"folder (its transformer/config.json is read) or a checkpoint model.family={model_cfg.family} "
                      f"declares ({known})")


def build_on_meta(arch: Architecture, **changes):
    import diffusers

    cls = getattr(diffusers, arch.class_name)
    with torch.device("meta"):
        return cls.from_config({**arch.config, **changes})


# ------------------------------------------------------------------------------------------ state bytes
def state_bytes(cfg, arch: Architecture, shards: int) -> dict:
    """Per-process bytes of what the optimizer and the references hold (see the module docstring)."""
    from .algorithms import make_algorithm
    from .policy import add_lora
    from .registry import adapter_class

    model = build_on_meta(arch)
    t = cfg.train
    total = sum(p.numel() for p in model.parameters())
    if t.lora.enabled:
        add_lora(model, t.lora, adapter_class(cfg.model.family).lora_targets)
        trained = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    else:
        trained = total
    frozen = total if t.lora.enabled else 0
    wbytes = DTYPE_BYTES[cfg.model.dtype]
    moments = 2 if t.optimizer == "adamw_8bit" else 8  # two moments, fp32 or 8-bit
    kl = t.kl_beta > 0 or t.kl_untrained_beta > 0
    algorithm = make_algorithm(cfg)
    out = {
        "weights": (frozen * wbytes + trained * 4) / shards,
        "gradients": trained * 4 / shards,
        "optimizer": trained * moments / shards,
        "ema": trained * 4 / shards if t.ema.enabled else 0,
        "reference": total * 4 / shards if kl and t.kl_reference == "initial" and not t.lora.enabled else 0,
        "old_policy": trained * 4 / shards if algorithm.keeps_old_policy else 0,
        "anchors": algorithm.reference_copies() * trained * 4 / shards,  # moving references, teachers
        "other_expert": total * wbytes if arch.experts == 2 else 0,  # held whole: frozen, bf16
    }
    return out, {"parameters": total, "trained": trained}


# ------------------------------------------------------------------------------------------ activations
def _saved_bytes(model, velocity) -> int:
    """Bytes autograd saves for the backward in one forward (each storage counted once)."""
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen and t.device.type != "meta":
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        velocity(model)
    return total


def activation_bytes(cfg, arch: Architecture) -> tuple[float, list[str]]:
    """Bytes of the update's activations per process (one micro-batch forward with gradients), and the
    assumptions behind the number."""
    import diffusers

    from .models.common import PromptEmbeds
    from .registry import adapter_class

    c = arch.config
    adapter_cls = adapter_class(cfg.model.family)
    heads_full, head_dim = adapter_cls.memory_heads(c)
    heads = min(heads_full, max(1, 256 // head_dim))
    counts = adapter_cls.memory_block_counts(c)
    cls = getattr(diffusers, arch.class_name)
    # the family's own transformer call, without a pipeline, with the run's family settings (frames, ...)
    shell = adapter_cls.bare(None, torch.float32, "cpu", **adapter_cls.options(cfg.model))
    tiny = cfg.model.pretrained in (None, "", "tiny") or str(cfg.model.pretrained).startswith("tiny")
    shape = adapter_cls.memory_latent_shape(cfg.model, c)  # a real checkpoint's (the tiny ones are measured below)
    text_tokens = adapter_cls.memory_text_tokens(cfg.model)
    text_dim = adapter_cls.memory_text_dim(c)
    pooled = c.get("pooled_projection_dim") or 0
    if tiny:
        from .models import load_adapter

        real = load_adapter(cfg.model)
        shape, cond = real.latent_shape(cfg.model.resolution), real.encode_prompts(["a"])
        text_tokens, text_dim, pooled = cond.embeds.shape[1], cond.embeds.shape[2], cond.pooled.shape[-1]

    source_shape = shape if tiny else adapter_cls.memory_source_shape(cfg.model, c)  # an editing family's sources

    def velocity(model):
        shell.transformer = model
        x = torch.randn(1, *shape)
        # an editing family's source images: more image tokens in every call
        sources = torch.randn(1, adapter_cls.max_sources, *source_shape) if adapter_cls.edits else None
        cond = PromptEmbeds(torch.randn(1, text_tokens, text_dim), torch.randn(1, pooled), None, sources)
        shell._forward(x, torch.full((1,), 0.5), cond)

    @keeps_generators  # the caller's generators are left as they were (the probe may run on one process only)
    def measure(blocks: dict[str, int]) -> int:
        torch.manual_seed(0)
        model = cls.from_config({**c, **adapter_cls.memory_narrow(c, heads, blocks)})
        model.train()
        return _saved_bytes(model, velocity)

    one = {k: 1 for k in counts}
    base = measure(one)
    per_block = {k: measure({**one, k: 2}) - base for k in counts}
    rest = base - sum(per_block.values())
    scale = heads_full / heads
    t = cfg.train
    # CFG doubles the training forward's rows; only the conditional half keeps a graph unless the unconditional one
    # is trained too (train.cfg_unconditional_grad)
    cfg_double = 2 if t.cfg and cfg.sampler.guidance_scale > 1 and t.cfg_unconditional_grad else 1
    rows = (1 if t.micro_batch == "auto" else t.micro_batch) * cfg_double
    precision = 0.5 if t.mixed_precision in ("bf16", "fp16") else 1.0
    if t.gradient_checkpointing:
        sources = adapter_cls.max_sources * math.prod(source_shape[1:]) // 4 if adapter_cls.edits else 0
        tokens = adapter_cls.memory_image_tokens(shape) + sources + text_tokens  # each block's saved input: (tokens, width), bound
        width = heads_full * head_dim
        body = max(per_block.values()) * scale + sum(counts.values()) * tokens * width * 4
    else:
        body = sum(per_block[k] * scale * counts[k] for k in counts)
    total = (rest * scale + body) * rows * precision
    notes = [f"activations measured on a replica with {heads} of {heads_full} attention heads and one or two of each "
             f"block ({', '.join(f'{k}={v}' for k, v in counts.items())} in the model), scaled x{scale:g} by width, "
             f"by the block counts, x{rows} inputs per forward (train.micro_batch={t.micro_batch}"
             f"{', doubled by CFG with a graph on both halves' if cfg_double == 2 else ''}) and x{precision:g} for "
             f"{t.mixed_precision if precision < 1 else 'fp32'}",
             "gradient checkpointing: one block's activations plus every block's input" if t.gradient_checkpointing
             else "no gradient checkpointing: every block's activations are kept to the backward"]
    return total, notes


def estimate(cfg, world_sizes: list[int], fsdp: bool | None = None, shard_size: int | None = None) -> dict:
    """Per-process GiB of each part at each world size; ``fsdp`` / ``shard_size`` override the config's."""
    arch = architecture(cfg.model)
    sharded = cfg.train.fsdp.enabled if fsdp is None else fsdp
    act, notes = activation_bytes(cfg, arch)
    table = []
    for world in world_sizes:
        shards = (shard_size or cfg.train.fsdp.shard_size or world) if sharded else 1
        shards = min(shards, world)
        parts, counts = state_bytes(cfg, arch, shards)
        parts["activations"] = act
        row = {"world_size": world, "shard_size": shards, **{k: v / GIB for k, v in parts.items()}}
        row["total"] = sum(v for k, v in row.items() if k not in ("world_size", "shard_size"))
        table.append(row)
    pool = cfg.sampler.pool
    if pool.size and pool.precision in ("int8", "fp8"):  # the quantized copy lives only during the cheap pass
        notes = notes + [f"sampler.pool.precision={pool.precision}: during the cheap rollout a one-byte copy of the "
                         f"linear weights (at most {counts['parameters'] / GIB:.2f} GiB) beside the weights, released "
                         "before the update, whose peak the table gives"]
    return {"model": arch.class_name, **counts, "experts": arch.experts, "fsdp": sharded, "per_process_gib": table,
            "assumptions": notes + ["weights: trained fp32 masters, frozen in model.dtype; AdamW: two fp32 moments; "
                                    "not counted: the text encoders and VAE (held outside the sharded module), CUDA "
                                    "context and allocator slack"]}


def available_bytes(device: torch.device) -> int:
    """Memory a process may fill: the GPU's total memory, or the host's available memory (MemAvailable)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        with open("/proc/meminfo") as fh:
            info = dict(line.split(":", 1) for line in fh)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 8 * GIB


def auto_micro_batch(cfg, device: torch.device, world: int, headroom: float = 0.8, most: int = 256,
                     capacity: int | None = None) -> tuple[int, dict]:
    """The largest micro-batch whose estimated per-process memory (state + activations per input x inputs) fits in
    ``headroom`` of the device's memory (``capacity`` bytes where given); (micro-batch, the numbers it came from).
    The headroom, 0.8, stays under 90% of the card: the estimate leaves out the CUDA context, the text encoders
    and VAE, and the allocator's slack. One line when not even one fits."""
    from .errors import ConfigError

    arch = architecture(cfg.model)
    cfg1 = cfg.model_copy(update={"train": cfg.train.model_copy(update={"micro_batch": 1})})
    per_input, _ = activation_bytes(cfg1, arch)
    shards = (cfg.train.fsdp.shard_size or world) if cfg.train.fsdp.enabled else 1
    state = sum(state_bytes(cfg, arch, min(shards, world))[0].values())
    budget = (capacity or available_bytes(device)) * headroom
    fits = int((budget - state) // per_input) if per_input > 0 else most
    if fits < 1:
        raise ConfigError(f"train.micro_batch=auto: not even one input fits: {state / GIB:.1f} GiB of weights and "
                          f"optimizer state plus {per_input / GIB:.1f} GiB of activations per input against "
                          f"{budget / GIB:.1f} GiB; enable train.gradient_checkpointing or train.fsdp")
    chosen = min(fits, most)
    return chosen, {"micro_batch": chosen, "budget_gib": budget / GIB, "state_gib": state / GIB,
                    "activations_per_input_gib": per_input / GIB, "device": str(device)}


def saved_micro_batch(run_dir) -> int | None:
    """The micro-batch a resumed run chose when it started (micro_batch.json in its folder), checked: a whole
    number >= 1, or one line saying what to do. None when the file is absent."""
    path = Path(run_dir) / "micro_batch.json"
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))["micro_batch"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"resume: {path} is unreadable ({type(exc).__name__}); delete it to choose the "
                          "micro-batch again, or set train.micro_batch to the run's number") from exc
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"resume: {path} holds micro_batch={value!r}, not a whole number >= 1; delete it to "
                          "choose the micro-batch again, or set train.micro_batch to the run's number")
    return value


def run_micro_batch(cfg, run_dir, device: torch.device, procs, resuming: bool) -> int:
    """The update's micro-batch for a run: ``train.micro_batch`` as given, or for ``auto`` the one chosen when the
    run started (micro_batch.json, on resume), or on a new run the largest that :func:`estimate` fits in the
    device's memory; the main process chooses and writes micro_batch.json, every process takes its choice."""
    if cfg.train.micro_batch != "auto":
        return cfg.train.micro_batch
    saved = saved_micro_batch(run_dir) if resuming else None
    if saved is not None:
        return saved
    from . import report

    chosen = None
    if procs.is_main:
        chosen, why = auto_micro_batch(cfg, device, procs.processes)
        report.atomic_write_bytes(run_dir / "micro_batch.json", json.dumps(why, indent=1).encode())
    return procs.broadcast(chosen)


def format_table(result: dict) -> str:
    cols = ["weights", "gradients", "optimizer", "ema", "reference", "old_policy", "anchors", "other_expert",
            "activations", "total"]
    head = f"{result['model']}: {result['parameters'] / 1e9:.2f}B parameters, {result['trained'] / 1e6:.1f}M trained" \
           f"{', two experts' if result['experts'] == 2 else ''}; FSDP {'on' if result['fsdp'] else 'off'}"
    lines = [head, "", "| processes | shard | " + " | ".join(cols) + " |", "|---" * (len(cols) + 2) + "|"]
    for row in result["per_process_gib"]:
        lines.append(f"| {row['world_size']} | {row['shard_size']} | "
                     + " | ".join(f"{row[c]:.2f}" for c in cols) + " |")
    lines += ["", "GiB per process. " + "; ".join(result["assumptions"])]
    return "\n".join(lines)
