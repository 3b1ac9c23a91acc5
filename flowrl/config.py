"""Typed configuration: a dataclass tree loaded from YAML with ``key.sub=value`` overrides.

Every problem (unknown key, wrong type, out-of-range value) is reported before any work starts, as one
line that names the key and, for unknown keys, suggests the closest valid one.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from .errors import ConfigError


def _range(lo=None, hi=None, choices=None, lo_open=False):
    return {"lo": lo, "hi": hi, "choices": choices, "lo_open": lo_open}


def opt(default, doc: str = "", **check):
    """A dataclass field with a default, a docstring and optional range/choice checks."""
    meta = {"doc": doc, **_range(**check)}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class TinyModelConfig:
    resolution: int = opt(16, "image size in pixels", lo=8)
    vae: bool = opt(False, "build a tiny AutoencoderKL (latent space) instead of pixel space")
    patch_size: int = opt(2, lo=1)
    num_layers: int = opt(2, lo=1)
    num_attention_heads: int = opt(2, lo=1)
    attention_head_dim: int = opt(32, lo=8)
    text_hidden: int = opt(32, "hidden size of each tiny CLIP text encoder", lo=8)
    text_projection: int = opt(32, lo=8)
    text_layers: int = opt(2, lo=1)
    max_tokens: int = opt(16, "tokenizer length of the tiny text encoders", lo=4)
    shift: float = opt(1.0, "scheduler shift of the tiny model", lo=0.0, lo_open=True)
    init_seed: int = opt(0, "seed of the random initialisation")
    experts: int = opt(1, "wan only: 2 builds Wan 2.2 A14B's layout, a high-noise and a low-noise transformer",
                       choices=[1, 2])


@dataclass
class ModelConfig:
    family: str = opt("sd3", "model family: sd3 (SD3 / SD3.5), flux (FLUX.1 dev / schnell), flux2 (FLUX.2 dev / "
                      "klein), qwenimage (Qwen-Image) or wan (Wan 2.1 / 2.2 text-to-video)",
                      choices=["sd3", "flux", "flux2", "qwenimage", "wan"])
    num_frames: int = opt(17, "video frames (wan): 4k + 1 for Wan's 4x temporal compression", lo=1)
    pretrained: Optional[str] = opt("tiny", "'tiny' (random init), 'tiny-shapes' / 'tiny-moving-shapes' (the shipped "
                                    "pretrained image / video models), a "
                                    "preset (sd3.5-medium, sd3.5-large), a hub id or a local diffusers folder")
    dtype: str = opt("fp32", "weights dtype of the transformer", choices=["fp32", "bf16", "fp16"])
    resolution: int = opt(16, "image resolution in pixels", lo=8)
    use_t5: bool = opt(True, "load the T5 encoder of real SD3 checkpoints")
    max_sequence_length: int = opt(256, "T5 tokens (real checkpoints only; FLUX.1-dev uses 512)", lo=0, hi=512)
    guidance: float = opt(3.5, "FLUX.1-dev's distilled guidance embedding (ignored by models without one)", lo=0.0)
    text_encoder_device: str = opt("same", "where the text encoders run: same (the model's device) or cpu (each prompt "
                                   "is encoded once and cached, so they need not hold accelerator memory)",
                                   choices=["same", "cpu"])
    vae_tiling: bool = opt(False, "decode with VAE slicing and tiling (large resolutions)")
    train_expert: str = opt("high_noise", "Wan 2.2 (two experts): the expert that is trained; the other stays "
                            "frozen and draws its own steps (sigma * 1000 below / above the pipeline's boundary)",
                            choices=["high_noise", "low_noise"])
    low_noise_guidance_scale: Optional[float] = opt(None, "Wan 2.2: the CFG scale of the low-noise expert's steps "
                                                    "(WanPipeline's guidance_scale_2); empty = sampler.guidance_scale",
                                                    lo=0.0)
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)


@dataclass
class SamplerConfig:
    num_steps: int = opt(10, "denoising steps of the rollout", lo=1)
    schedule: str = opt("diffusers", "sigma grid", choices=["diffusers", "static_shift", "dynamic_shift"])
    shift: float = opt(3.0, "shift for static_shift", lo=0.0, lo_open=True)
    kernel: str = opt("flow_grpo", "SDE step kernel", choices=["flow_grpo", "dance", "cps"])
    noise_level: float = opt(0.7, "a for flow_grpo/cps, eta for dance", lo=0.0)
    guidance_scale: float = opt(1.0, "CFG scale in rollout and training (1 = off)", lo=0.0)
    negative_prompt: str = opt("", "negative prompt used with CFG")
    eval_num_steps: int = opt(10, "ODE steps for sample grids and evaluation", lo=1)
    rollout_batches: int = opt(1, "split each iteration's prompts into this many rollout batches (memory; and with "
                               "async_reward, scoring batch k overlaps the rollout of batch k+1)", lo=1)
    pack_rollouts: bool = opt(False, "run a process's rollout batches staggered through shared transformer calls, so "
                              "a batch's narrow first tree rounds fill the calls of the batch ahead of it (same trees)")
    pack_stagger: int = opt(0, "rounds between the starts of packed batches (0: num_steps / batches, rounded up)",
                            lo=0)
    async_reward: bool = opt(True, "score a rollout batch in a background thread while the next batch is rolled out")
    max_batch: int = opt(64, "most tree nodes per transformer call (rollout, sampling and evaluation)", lo=1)
    noise_device: str = opt("cpu", "where rollout noise is drawn: cpu (bit-exact across devices and batchings) or "
                            "device (the accelerator's generator: no host-to-device copy per round)",
                            choices=["cpu", "device"])
    noise_lowpass: int = opt(0, "k > 0: SDE noise only in the k x k lowest spatial DCT frequencies of the latent "
                             "(ODE in every other direction; flow_grpo and dance kernels); 0: noise in every "
                             "direction", lo=0)
    noise_lowpass_skip_dc: bool = opt(False, "with noise_lowpass: leave each channel's constant term (a global colour "
                                      "shift, which a shape reward cannot credit) to the ODE")
    cps_log_prob: str = opt("gaussian", "cps kernel: the true Gaussian log-prob, or the paper's and Flow-GRPO's "
                            "unnormalised -(x' - mean)^2 (published CPS clip ranges assume it)",
                            choices=["gaussian", "published"])


@dataclass
class AlgorithmOptions:
    """What every algorithm's options share: its registered name. Each algorithm module defines its own
    ``Options`` subclass (flowrl/algorithms); ``algorithm:`` in a config accepts only that algorithm's keys."""

    name: str = opt("flow_grpo", "a registered algorithm (flowrl/algorithms) or module:Class of a plug-in")


@dataclass
class AdvantageConfig:
    std: str = opt("group", "normalise by each group's std or the batch's", choices=["group", "global"])
    ddof: int = opt(0, "0 = numpy std (Flow-GRPO), 1 = torch.std (DanceGRPO)", lo=0, hi=1)
    eps: float = opt(1e-4, lo=0.0)
    clip: float = opt(5.0, "clip advantages to +-clip", lo=0.0, lo_open=True)
    zero_std_threshold: float = opt(1e-6, "groups with std below this count as zero-variance", lo=0.0)
    zero_variance: str = opt("zero", "what zero-variance groups get: zero advantage (kept, no gradient), global "
                             "(z-score against the batch mean and std), tracker (r - the prompt's Beta-tracker "
                             "value, over the batch std), or drop_refill (roll out refill_extra more prompts and "
                             "train on the first prompts_per_iter groups that vary)",
                             choices=["zero", "global", "tracker", "drop_refill"])
    refill_extra: int = opt(2, "drop_refill: extra prompts rolled out per iteration", lo=0)
    tracker_rho: float = opt(0.9, "zero_variance=tracker: the Beta tracker's forgetting factor", lo=0.0, hi=1.0)
    tracker_reward_range: list[float] = opt([0.0, 1.0], "zero_variance=tracker: rewards are mapped from this range "
                                            "to [0, 1] for the tracker")
    combine: str = opt("sum", "several rewards: 'sum' = advantages of the weighted reward sum (Flow-GRPO); "
                       "'per_reward' = each reward's own advantage (normalised in its own groups), weighted and "
                       "summed (DanceGRPO's multi-reward)", choices=["sum", "per_reward"])


@dataclass
class LoraConfig:
    enabled: bool = opt(True, "LoRA through peft; false = full fine-tuning")
    rank: int = opt(8, lo=1)
    alpha: float = opt(16.0, lo=0.0, lo_open=True)
    targets: list[str] = opt([], "module names; empty = the model family's defaults")


@dataclass
class EmaConfig:
    enabled: bool = opt(False)
    decay: float = opt(0.9, lo=0.0, hi=1.0)
    update_every: int = opt(1, lo=1)


@dataclass
class TrainConfig:
    iterations: int = opt(30, "rollout + update iterations", lo=1)
    prompts_per_iter: int = opt(4, "distinct prompts (groups) per iteration", lo=1)
    lr: float = opt(3e-4, lo=0.0, lo_open=True)
    betas: list[float] = opt([0.9, 0.999])
    weight_decay: float = opt(1e-4, lo=0.0)
    adam_eps: float = opt(1e-8, lo=0.0, lo_open=True)
    clip_range: float = opt(1e-4, "PPO clip on the per-element-mean log-prob ratio", lo=0.0, lo_open=True)
    kl_beta: float = opt(0.0, "KL to the reference policy (train.kl_reference)", lo=0.0)
    grpo_guard: bool = opt(False, "GRPO-Guard: each edge's log-ratio centred and scaled by its transition std "
                           "(ratio normalisation), and each step's loss divided by its |dt|; stores each edge's "
                           "sampling mean (one more latent per node). Flow-SDE kernel (flow_grpo) only")
    kl_reference: str = opt("initial", "the KL's reference: initial (the starting weights: LoRA disabled, or a frozen "
                            "copy under full fine-tuning) or ema (the EMA of the trained weights; needs train.ema)",
                            choices=["initial", "ema"])
    kl_untrained_beta: float = opt(0.0, "KL to the reference at the steps the window does not train: each update "
                                   "draws train.kl_untrained_states of the rollout's states whose next step is "
                                   "untrained (ODE) and adds beta x their mean KL of the full-rank SDE transition at "
                                   "sampler.noise_level. The weights are shared by all steps, so training the window "
                                   "also moves the others (background texture drawn late); this holds them", lo=0.0)
    kl_untrained_states: int = opt(16, "untrained states drawn per optimizer step for train.kl_untrained_beta", lo=1)
    kl_std: str = opt("transition", "std dividing the KL's mean difference: the transition's full std (ours), or "
                      "Flow-GRPO's std without the sqrt(|dt|) factor (so its published beta values carry over)",
                      choices=["transition", "flow_grpo"])
    max_grad_norm: float = opt(1.0, lo=0.0, lo_open=True)
    num_minibatches: int = opt(1, "optimizer steps per inner epoch (trained edges split evenly)", lo=1)
    inner_epochs: int = opt(1, lo=1)
    micro_batch: int = opt(64, "most parent states per forward/backward (gradient accumulation)", lo=1)
    cfg: bool = opt(True, "apply CFG in the training forward when guidance_scale > 1")
    mixed_precision: str = opt("no", "autocast of the transformer's forward; latents, SDE maths and trainable weights "
                               "stay fp32", choices=["no", "fp16", "bf16"])
    optimizer: str = opt("adamw", "adamw (fused on CUDA) or adamw_8bit (bitsandbytes, CUDA)",
                         choices=["adamw", "adamw_8bit"])
    fused_loss: bool = opt(False, "the per-edge log-prob, ratio, clip and KL as one torch.compile'd function "
                           "(equals the eager path; for per-edge algorithms)")
    compile_transformer: bool = opt(False, "torch.compile the transformer's repeated blocks")
    gradient_checkpointing: bool = opt(False, "recompute block activations in the backward (memory for time)")
    attention_backend: str = opt("native", "diffusers attention backend: native (PyTorch SDPA), xformers (the "
                                 "xformers extra), flash (flash-attn)", choices=["native", "xformers", "flash"])
    log_prob_reduce: str = opt("mean", "mean over latent elements (the anchors' convention) or sum", choices=["mean", "sum"])
    lora: LoraConfig = field(default_factory=LoraConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)
    seed: int = opt(0)


@dataclass
class RewardSpec:
    name: str = opt("jpeg_compressibility", "registered name or module:function")
    weight: float = opt(1.0)
    args: dict[str, Any] = opt({}, "keyword arguments for the reward's constructor")


@dataclass
class DataConfig:
    prompts: list[str] = opt([], "training prompts (or use prompt_file)")
    prompt_file: Optional[str] = opt(None, ".txt (one per line) or .jsonl with a 'prompt' field")
    prompt_set: str = opt("none", "a registered prompt set instead of prompts/prompt_file (shapes-train, "
                          "shapes-heldout) or module:function")
    sample_prompts: list[str] = opt([], "prompts of the sample grids (default: the first training prompts)")
    sample_seeds: list[int] = opt([0, 1, 2, 3])


@dataclass
class LogConfig:
    output_dir: str = opt("runs", "parent folder of run directories")
    run_name: Optional[str] = opt(None, "run folder name (default: config name + time)")
    sample_every: int = opt(10, "iterations between sample grids (0 = only start and end)", lo=0)
    save_every: int = opt(10, "iterations between checkpoints (0 = only at the end)", lo=0)
    keep_checkpoints: int = opt(2, lo=1)
    trackers: list[str] = opt([], "accelerate trackers: tensorboard, wandb")
    progress: bool = opt(True, "progress bars")
    eval: str = opt("none", "held-out evaluation before and after training: none, a registered evaluator (shapes) "
                    "or module:Class")
    eval_seeds: list[int] = opt([0, 1, 2, 3, 4, 5, 6, 7], "seeds per held-out prompt")
    eval_every: int = opt(0, "iterations between held-out curve points in eval_curve.jsonl (0 = none)", lo=0)
    eval_curve_seeds: int = opt(4, "the curve uses the first N of eval_seeds (cheaper than the full evaluation)", lo=1)
    best_metric: str = opt("", "the held-out curve's number to maximise (a key of the evaluator's result) for "
                           "the best checkpoint and early stopping; empty = the evaluator's headline number")
    keep_best: bool = opt(True, "with log.eval_every: keep the weights of the best curve point in checkpoints/best "
                          "and end the run with them (the 'after' evaluation, the last grid)")
    early_stop_patience: int = opt(0, "stop after this many curve points in a row without a new best (0 = never)",
                                   lo=0)
    early_stop_drop: float = opt(0.0, "stop when a curve point falls this far below the best (e.g. 0.1 = 10 "
                                 "points of accuracy; 0 = never)", lo=0.0)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    algorithm: AlgorithmOptions = field(default_factory=AlgorithmOptions)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    rewards: list[RewardSpec] = field(default_factory=lambda: [RewardSpec()])
    data: DataConfig = field(default_factory=DataConfig)
    log: LogConfig = field(default_factory=LogConfig)
    resume: Optional[str] = opt(None, "'latest' or a checkpoint folder to resume from")
    device: str = opt("auto", choices=["auto", "cpu", "cuda"])


# --------------------------------------------------------------------------------------------- parsing
def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " or null"
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _coerce(value, tp, key: str):
    """Check ``value`` against annotation ``tp`` and convert where lossless; raise ConfigError otherwise."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return _build(tp, value, key)
    if origin is list:
        (item,) = typing.get_args(tp)
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if not math.isfinite(number):  # nan passes every range check (nan < lo is false)
            raise ConfigError(f"{key}: {value!r} is not a finite number")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported type {tp}")


def _check_range(value, meta, key):
    if value is None or not meta:
        return
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(str, choices))}{hint}")
    lo, hi = meta.get("lo"), meta.get("hi")
    if lo is not None and (value < lo or (meta.get("lo_open") and value == lo)):
        raise ConfigError(f"{key}: {value!r} is out of range; it must be {'>' if meta.get('lo_open') else '>='} {lo}")
    if hi is not None and value > hi:
        raise ConfigError(f"{key}: {value!r} is out of range; it must be <= {hi}")


def _all_keys(cls, prefix="") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name}"
        keys.append(name)
        hints = typing.get_type_hints(cls)
        if dataclasses.is_dataclass(hints[f.name]):
            keys += _all_keys(hints[f.name], name + ".")
    return keys


def _unknown(key: str, cls, prefix: str) -> ConfigError:
    valid = _all_keys(cls, prefix)
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"unknown config key {key!r}{hint}")


# keys that moved in the per-algorithm redesign: the old spelling -> what to write now
MOVED = {"algorithm.max_batch": "sampler.max_batch", "algorithm.loss_weight": "algorithm.loss_weight (tempflow_grpo, "
         "superflow only)"}
_FLATTENED = ("tree", "side", "chunk", "tracker", "curriculum")  # sub-sections of the early layout, now flat


def _build_algorithm(value, key: str):
    """The ``algorithm`` section: its ``name`` picks the registered algorithm, whose ``Options`` dataclass then
    takes the remaining keys (only that algorithm's)."""
    from .registry import algorithm_class

    if isinstance(value, AlgorithmOptions):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected a mapping such as {{name: flow_grpo, group_size: 8}}, got {value!r}")
    name = value.get("name", AlgorithmOptions.name)
    if not isinstance(name, str):
        raise ConfigError(f"{key}.name: expected a string, got {name!r}")
    options = algorithm_class(name).Options
    data = dict(value)
    for sub in _FLATTENED:  # old-style keys written by hand: say where they went
        if isinstance(data.get(sub), dict):
            raise ConfigError(f"{key}.{sub}: the {sub} options now sit directly under algorithm (e.g. "
                              f"algorithm.{next(iter(data[sub]), 'name')}); see configs/ for the current form")
    return _build(options, {**data, "name": name}, key)


def _build(cls, data: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in names:
            if key in MOVED:
                raise ConfigError(f"config key {key!r} has moved: use {MOVED[key]}")
            if issubclass(cls, AlgorithmOptions):
                valid = ", ".join(f.name for f in dataclasses.fields(cls) if f.name != "name")
                close = difflib.get_close_matches(str(k), [f.name for f in dataclasses.fields(cls)], n=1)
                hint = f"did you mean {prefix}.{close[0]!r}? " if close else ""
                raise ConfigError(f"{key}: not an option of {data.get('name', cls.name)}; {hint}its options: {valid}")
            raise _unknown(key, cls, f"{prefix}." if prefix else "")
        choices = names[k].metadata.get("choices") or []
        if isinstance(v, bool) and hints[k] is str and ("no" if not v else "yes") in choices:
            v = "no" if not v else "yes"  # YAML 1.1 reads `no` as false: accelerate's documented word is "no"
        value = _build_algorithm(v, key) if hints[k] is AlgorithmOptions else _coerce(v, hints[k], key)
        _check_range(value, names[k].metadata, key)
        kwargs[k] = value
    return cls(**kwargs)


def _merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for k, v in override.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


_INDEXED = re.compile(r"^(\w+)\[(\d+)\]$")


def parse_override(text: str) -> tuple[list, object]:
    """``a.b[1].c=value`` -> (['a', ('b', 1), 'c'], value), the value parsed as YAML (numbers, lists, bools)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r} has no key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    parts: list = []
    for p in key.split("."):
        m = _INDEXED.match(p)
        parts.append((m.group(1), int(m.group(2))) if m else p)
    return parts, value


def apply_override(data: dict, text: str) -> dict:
    """Set one override in the raw config mapping; ``name[i]`` indexes a list entry (``rewards[0].name=shapes``;
    ``rewards[1].name=...`` appends a second reward)."""
    parts, value = parse_override(text)
    cur = data
    for k, p in enumerate(parts):
        last = k == len(parts) - 1
        if isinstance(p, tuple):
            name, idx = p
            lst = cur.get(name)
            if lst is None and name == "rewards":  # the default reward list, so rewards[0].weight=2 works alone
                lst = [{"name": RewardSpec().name}]
            lst = list(lst or [])
            if idx > len(lst):
                raise ConfigError(f"override {text!r}: {name} has {len(lst)} entries; index {idx} would leave a gap")
            if idx == len(lst):
                lst.append({})
            cur[name] = lst
            if last:
                lst[idx] = value
            else:
                if not isinstance(lst[idx], dict):
                    lst[idx] = {}
                cur = lst[idx]
        elif last:
            cur[p] = _merge(cur[p], value) if isinstance(value, dict) and isinstance(cur.get(p), dict) else value
        else:
            if not isinstance(cur.get(p), dict):
                cur[p] = {}
            cur = cur[p]
    return data


class _DuplicateKey(yaml.YAMLError):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key that appears twice in one mapping (plain YAML keeps the later one, so a
    second ``train:`` block would silently replace the first)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise _DuplicateKey(f"key {key!r} appears twice in one mapping (lines {seen[key] + 1} and "
                                    f"{key_node.start_mark.line + 1}); keep one and merge the settings into it")
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load YAML (or defaults), apply overrides, validate; raises ConfigError with one clear line."""
    data: dict = {}
    if path is not None:
        from .resources import find_config

        found = find_config(path)
        if found is None:
            raise ConfigError(f"config file not found: {path} (nor a shipped preset of that name; "
                              "see `flowrl presets`)")
        path = found
        try:
            data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader) or {}
        except _DuplicateKey as exc:
            raise ConfigError(f"{path}: {exc}") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}); save the config as UTF-8") from exc
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            raise ConfigError(f"{path}: invalid YAML{where}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of config sections")
    for text in overrides or []:
        data = apply_override(data, text)
    data.setdefault("algorithm", {})  # the default algorithm's own options class, not the bare base
    cfg = _build(Config, data)
    if cfg.data.prompt_file:
        cfg.data.prompt_file = str(_resolve_data_path(cfg.data.prompt_file, path))
    validate(cfg)
    return cfg


def _resolve_data_path(name: str, config_path: Path | None) -> Path:
    """A relative data path as written in a config: from the current folder, else beside the config file, else
    in the shipped assets (``assets/prompts/x.txt``), so a preset runs from any folder."""
    from .resources import assets_dir

    p = Path(name).expanduser()
    if p.is_absolute() or p.exists():
        return p
    candidates = []
    if config_path is not None:
        candidates.append(Path(config_path).parent / p)
    parts = p.parts[1:] if p.parts and p.parts[0] == "assets" else p.parts
    candidates.append(assets_dir().joinpath(*parts))
    return next((c for c in candidates if c.exists()), p)


def validate(cfg: Config) -> None:
    """Cross-field checks that a single field's range cannot express, the algorithm's own among them: all of
    them run here, at load, before a model is loaded or a file written."""
    from .registry import algorithm_class

    if not cfg.rewards:
        raise ConfigError("rewards: list at least one reward, e.g. rewards=[{name: jpeg_compressibility}]")
    if cfg.advantage.combine == "per_reward" and cfg.advantage.zero_variance in ("tracker", "drop_refill"):
        raise ConfigError("advantage.combine=per_reward: the prompt tracker of zero_variance tracker|drop_refill "
                          "follows the summed reward; use advantage.combine=sum")
    lo, hi = cfg.advantage.tracker_reward_range if len(cfg.advantage.tracker_reward_range) == 2 else (0, 0)
    if not lo < hi:
        raise ConfigError(f"advantage.tracker_reward_range {cfg.advantage.tracker_reward_range} must be [low, high] "
                          "with low < high")
    if len(cfg.train.betas) != 2 or not all(0 <= b < 1 for b in cfg.train.betas):
        raise ConfigError(f"train.betas: {cfg.train.betas} must be two numbers in [0, 1), e.g. [0.9, 0.999]")
    if (cfg.log.early_stop_patience or cfg.log.early_stop_drop) and not (cfg.log.eval_every and cfg.log.eval != "none"):
        raise ConfigError("log.early_stop_patience / log.early_stop_drop watch the held-out curve; set log.eval (e.g. "
                          "shapes) and log.eval_every (e.g. 10)")
    for key, seeds in (("data.sample_seeds", cfg.data.sample_seeds), ("log.eval_seeds", cfg.log.eval_seeds)):
        if not seeds:
            raise ConfigError(f"{key}: list at least one seed, e.g. [0, 1, 2, 3]")
    m = cfg.model
    tiny = m.pretrained in (None, "", "tiny")
    from .registry import MODEL_NAMES

    if m.pretrained in MODEL_NAMES:  # an embedded model: its adapter checks its exact geometry at load
        factor = 1
    elif m.family in ("flux", "flux2", "qwenimage", "wan"):  # VAE (tiny: 2, real: 8) x 2x2 packing / patches
        factor = 4 if tiny else 16
    else:
        factor = m.tiny.patch_size * (2 if m.tiny.vae else 1) if tiny else 16  # SD3: VAE 8 x patch 2
    if m.resolution % factor:
        lo = m.resolution - m.resolution % factor
        raise ConfigError(f"model.resolution: {m.resolution} px is not a multiple of {factor} (the latent patch "
                          f"grid of this model); use {lo or factor} or {lo + factor}")
    for key, value, package, extra in (("train.optimizer", cfg.train.optimizer == "adamw_8bit", "bitsandbytes", "bitsandbytes"),
                                       ("train.attention_backend", cfg.train.attention_backend == "xformers", "xformers",
                                        "xformers"),
                                       ("train.attention_backend", cfg.train.attention_backend == "flash", "flash_attn",
                                        "flash-attn")):
        if value and importlib.util.find_spec(package) is None:
            raise ConfigError(f"{key}: needs the {extra} package (pip install 'flowrl-tree[{extra}]' or pip install "
                              f"{extra}); or set it back to its default")
    if cfg.train.grpo_guard and cfg.sampler.kernel != "flow_grpo":
        raise ConfigError(f"train.grpo_guard: GRPO-Guard normalises Flow-SDE transitions; set sampler.kernel=flow_grpo "
                          f"(not {cfg.sampler.kernel}) or train.grpo_guard=false")
    if cfg.sampler.noise_lowpass_skip_dc and cfg.sampler.noise_lowpass < 2:
        raise ConfigError(f"sampler.noise_lowpass_skip_dc: needs sampler.noise_lowpass of at least 2 (it is "
                          f"{cfg.sampler.noise_lowpass}), or sampler.noise_lowpass_skip_dc=false")
    if cfg.sampler.noise_lowpass and cfg.sampler.kernel == "cps":
        raise ConfigError("sampler.noise_lowpass: the cps kernel has no score correction to restrict; use "
                          "sampler.kernel=flow_grpo or dance, or sampler.noise_lowpass=0")
    if cfg.train.kl_untrained_beta > 0 and cfg.sampler.noise_level <= 0:
        raise ConfigError("train.kl_untrained_beta: the KL of an untrained step uses the SDE transition at "
                          "sampler.noise_level, which is 0; set sampler.noise_level > 0 or train.kl_untrained_beta=0")
    if (cfg.train.kl_beta > 0 or cfg.train.kl_untrained_beta > 0) and cfg.train.kl_reference == "ema" \
            and not cfg.train.ema.enabled:
        raise ConfigError("train.kl_reference=ema: the reference is the EMA of the weights; set "
                          "train.ema.enabled=true or train.kl_reference=initial")
    if cfg.train.kl_beta > 0 and cfg.train.kl_std == "flow_grpo" and cfg.sampler.kernel == "cps":
        raise ConfigError("train.kl_std=flow_grpo: the cps kernel's std has no sqrt(|dt|) factor to remove; "
                          "use train.kl_std=transition")
    algorithm_class(cfg.algorithm.name).check(cfg)


def to_dict(cfg) -> dict:
    """The resolved config as plain data; the algorithm section holds only its own algorithm's options."""
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


# --------------------------------------------------------------------------------------------- schema
def _field_schema(tp, meta: dict | None = None) -> dict:
    """JSON Schema of one annotation, with the field's description, range and choices from its metadata."""
    meta = meta or {}
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        options = [_field_schema(a) for a in typing.get_args(tp) if a is not type(None)]
        out = {"anyOf": options + [{"type": "null"}]} if type(None) in typing.get_args(tp) else {"anyOf": options}
    elif tp is AlgorithmOptions:
        out = _algorithm_schema()
    elif dataclasses.is_dataclass(tp):
        out = _dataclass_schema(tp)
    elif origin is list:
        out = {"type": "array", "items": _field_schema(typing.get_args(tp)[0])}
    elif origin is dict:
        out = {"type": "object"}
    else:
        out = {bool: {"type": "boolean"}, int: {"type": "integer"}, float: {"type": "number"},
               str: {"type": "string"}}.get(tp, {})
    if meta.get("doc"):
        out["description"] = meta["doc"]
    if meta.get("choices") is not None:
        out["enum"] = list(meta["choices"]) + ([False] if "no" in meta["choices"] else [])  # YAML 1.1 `no`
    if meta.get("lo") is not None:
        out["exclusiveMinimum" if meta.get("lo_open") else "minimum"] = meta["lo"]
    if meta.get("hi") is not None:
        out["maximum"] = meta["hi"]
    return out


def _dataclass_schema(cls, title: str | None = None) -> dict:
    hints = typing.get_type_hints(cls)
    props = {}
    for f in dataclasses.fields(cls):
        props[f.name] = _field_schema(hints[f.name], dict(f.metadata))
        if f.default is not dataclasses.MISSING:
            props[f.name]["default"] = f.default
        elif f.default_factory is not dataclasses.MISSING and not dataclasses.is_dataclass(hints[f.name]):
            default = f.default_factory()
            props[f.name]["default"] = [dataclasses.asdict(d) if dataclasses.is_dataclass(d) else d for d in default] \
                if isinstance(default, list) else default
    out = {"type": "object", "properties": props, "additionalProperties": False}
    if title or cls.__doc__ and not cls.__doc__.startswith(f"{cls.__name__}("):
        out["title"] = title or cls.__name__
    return out


def _algorithm_schema() -> dict:
    """The ``algorithm`` section: one alternative per registered algorithm, chosen by ``name`` (a discriminated
    union: its options are that algorithm's only)."""
    from .registry import ALGORITHMS, algorithm_class

    alternatives = []
    for name in sorted(ALGORITHMS):
        options = algorithm_class(name).Options
        alt = _dataclass_schema(options, title=name)
        alt["properties"]["name"] = {"const": name, "description": AlgorithmOptions.__dataclass_fields__["name"]
                                     .metadata["doc"]}
        alt["required"] = ["name"] if name != AlgorithmOptions.name else []
        alternatives.append(alt)
    return {"description": "the algorithm (name) and its own options", "oneOf": alternatives}


def json_schema() -> dict:
    """The JSON Schema of a config file (draft 2020-12): editors complete and check YAML with it
    (``# yaml-language-server: $schema=flowrl.schema.json``). Each key carries its description, default, range
    and choices."""
    schema = _dataclass_schema(Config, title="flowrl config")
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


def explain(key: str) -> str:
    """A key's type, default, range or choices and description, for ``flowrl config explain KEY``."""
    cls, parts, f, owner = Config, key.split("."), None, ""
    for depth, part in enumerate(parts):
        if cls is AlgorithmOptions:  # the options of the algorithms that have this key (the default one first)
            from .registry import ALGORITHMS, algorithm_class

            names = sorted(ALGORITHMS, key=lambda n: n != AlgorithmOptions.name)
            having = [n for n in names if part in {x.name for x in dataclasses.fields(algorithm_class(n).Options)}]
            if not having:
                raise ConfigError(f"{key}: no algorithm has the option {part!r} (see `flowrl config schema`)")
            cls = algorithm_class(having[0]).Options
            owner = f" (an option of {', '.join(having)})" if part != "name" else ""
        fields = {x.name: x for x in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
        if part not in fields:
            raise _unknown(key, Config, "")
        f = fields[part]
        tp = typing.get_type_hints(cls)[part]
        if depth < len(parts) - 1:
            if not (dataclasses.is_dataclass(tp) or tp is AlgorithmOptions):
                raise _unknown(key, Config, "")
            cls = tp
    if dataclasses.is_dataclass(tp):
        return f"{key}: a section with keys {', '.join(x.name for x in dataclasses.fields(tp))}"
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if isinstance(default, list):
        default = [dataclasses.asdict(d) if dataclasses.is_dataclass(d) else d for d in default]
    meta = f.metadata
    lines = [f"{key}{owner}", f"  type: {_type_name(tp)}", f"  default: {yaml.safe_dump(default, default_flow_style=True).strip().removesuffix('...').strip()}"]
    if meta.get("choices") is not None:
        lines.append(f"  choices: {', '.join(map(str, meta['choices']))}")
    if meta.get("lo") is not None or meta.get("hi") is not None:
        lo = "" if meta.get("lo") is None else f"{'>' if meta.get('lo_open') else '>='} {meta['lo']}"
        hi = "" if meta.get("hi") is None else f"<= {meta['hi']}"
        lines.append(f"  range: {' and '.join(x for x in (lo, hi) if x)}")
    if meta.get("doc"):
        lines.append(f"  {meta['doc']}")
    return "\n".join(lines)
