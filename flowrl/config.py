"""Typed configuration: a dataclass tree loaded from YAML with ``key.sub=value`` overrides.

Every problem (unknown key, wrong type, out-of-range value) is reported before any work starts, as one
line that names the key and, for unknown keys, suggests the closest valid one.
"""

from __future__ import annotations

import dataclasses
import difflib
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


@dataclass
class ModelConfig:
    family: str = opt("sd3", choices=["sd3"])
    pretrained: Optional[str] = opt("tiny", "'tiny' (random init), 'tiny-shapes' (the shipped pretrained model), a "
                                    "preset (sd3.5-medium, sd3.5-large), a hub id or a local diffusers folder")
    dtype: str = opt("fp32", "weights dtype of the transformer", choices=["fp32", "bf16", "fp16"])
    resolution: int = opt(16, "image resolution in pixels", lo=8)
    use_t5: bool = opt(True, "load the T5 encoder of real SD3 checkpoints")
    max_sequence_length: int = opt(256, "T5 tokens (real checkpoints only)", lo=0, hi=512)
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
    async_reward: bool = opt(True, "score a rollout batch in a background thread while the next batch is rolled out")


@dataclass
class WindowConfig:
    size: int = opt(0, "SDE window length in steps (0 = no window: all steps SDE); with flow_grpo, dance_grpo, "
                       "chunk_grpo or superflow a window makes only its steps SDE and trained", lo=0)
    placement: str = opt("fixed", choices=["fixed", "random", "progressive"])
    start: int = opt(0, "first window step for fixed placement", lo=0)
    range_start: int = opt(0, "earliest window start (random / progressive)", lo=0)
    range_end: int = opt(-1, "window must end by this step (-1 = num_steps - 1)")
    stride: int = opt(1, "progressive: steps the window moves each shift", lo=0)
    iters_per_shift: int = opt(25, "progressive: iterations before the window moves", lo=1)
    roll_back: bool = opt(True, "progressive: restart at range_start after the last position")


@dataclass
class TreeConfig:
    """BranchGRPO (algorithm.name = branch_grpo)."""

    split_steps: list[int] = opt([0, 3, 6, 9], "step indices where every node branches")
    branch_factor: int = opt(2, "children per node at a split step (K); leaves = K ** len(split_steps)", lo=2)
    sibling_noise: str = opt("correlated", "correlated: the paper's marginal-preserving sibling noise; scaled: the "
                             "released code (independent noise x strength, log-prob under the unscaled std)",
                             choices=["correlated", "scaled", "independent"])
    sibling_strength: float = opt(4.0, "s of the correlated construction, or the code's noise scale", lo=0.0)
    fusion: str = opt("uniform", "leaf rewards -> node values: uniform mean, the paper's path-probability "
                      "weighting (beta), or the code's recursive child-edge softmax",
                      choices=["uniform", "path_weighted", "edge_softmax"])
    fusion_beta: float = opt(1.0, "beta of path_weighted / edge_softmax fusion")
    width_pruning: str = opt("none", "drop gradient work after the last split",
                             choices=["none", "parent_top1", "extreme", "chain_ratio", "global_ratio"])
    width_ratio: float = opt(0.5, "chain_ratio / global_ratio: fraction of post-split edges kept", lo=0.0, hi=1.0)
    extreme_b: int = opt(0, "extreme: best and worst leaves kept per tree (0 = a quarter of the leaves)", lo=0)
    depth_pruning: list[int] = opt([], "child depths whose edges are not trained at iteration 0 (empty = off)")
    depth_slide_every: int = opt(30, "iterations between moves of the depth window (one depth earlier)", lo=1)
    depth_stop: int = opt(-1, "the window stops when its shallowest depth reaches this (-1 = last split + 1)")
    prune_until: float = opt(1.0, "prune only while iteration < prune_until * train.iterations", lo=0.0, hi=1.0)
    mix: bool = opt(False, "BranchGRPO-Mix: ODE outside split steps and algorithm.window; only SDE edges trained")


@dataclass
class SideConfig:
    """TempFlow-GRPO and E-GRPO: an ODE main line with group_size one-step SDE branches at active steps."""

    steps: list[int] = opt([], "active steps (empty: tempflow_grpo all but the last, e_grpo the first half)")
    seeds: int = opt(1, "main lines (initial noises) per prompt", lo=1)
    group_by: str = opt("prompt", "advantage group per active step: all seeds of the prompt (released TempFlow "
                        "code, E-GRPO) or one seed's branches (TempFlow paper)", choices=["prompt", "seed"])
    merge: str = opt("adaptive", "e_grpo: merge lengths from the entropy rule (adaptive) or merge_lengths (list)",
                     choices=["adaptive", "list"])
    merge_lengths: list[int] = opt([], "e_grpo with merge=list: one length per active step")
    granularities: list[int] = opt([1], "completion strides; [1, 2] is G2RPO's multi-granularity completion "
                                   "(E-GRPO's released code): one ODE finish per stride, each normalised in its "
                                   "own group, advantages summed")
    tau: float = opt(2.2, "e_grpo entropy threshold")
    tau_scale: str = opt("exp_entropy_per_dim", "what tau is compared with: exp(h/d) (default), the variance "
                         "2 pi e s^2, or its log", choices=["exp_entropy_per_dim", "variance", "log_variance"])


@dataclass
class ChunkConfig:
    """Chunk-GRPO (algorithm.name = chunk_grpo): the first T - 1 transitions in consecutive chunks."""

    mode: str = opt("fixed", "fixed sizes (the released code), uniform size, or the v3 paper's adaptive split",
                    choices=["fixed", "uniform", "adaptive"])
    sizes: list[int] = opt([2, 3, 4, 7], "fixed: chunk sizes, high noise first; must sum to num_steps - 1")
    size: int = opt(4, "uniform: transitions per chunk", lo=1)
    min_size: int = opt(2, "adaptive: chunks are not split below this size", lo=1)
    sampling: str = opt("uniform", "which chunks are trained: uniform without replacement, or weighted by the "
                        "chunk's mean relative-L1 latent change", choices=["uniform", "weighted"])
    weight_norm: str = opt("l1", "weighted sampling: l1-normalised means or their softmax", choices=["l1", "softmax"])


@dataclass
class TrackerConfig:
    """SuperFlow (algorithm.name = superflow) and the `tracker` zero-variance policy: a per-prompt Beta tracker.
    SuperFlow has no public code; the binning, the group-size mapping and the KL-adaptive forgetting are
    assumptions documented in flowrl/trackers.py."""

    rho: float = opt(0.9, "forgetting factor per visit", lo=0.0, hi=1.0)
    rho_mode: str = opt("constant", "constant rho, or SPO's KL-adaptive clip(2^(-D/d_half), rho_min, 0.96) with D "
                        "the last update's mean |log-prob change|", choices=["constant", "kl_adaptive"])
    d_half: float = opt(0.06, lo=0.0, lo_open=True)
    rho_min: float = opt(0.5, lo=0.0, hi=1.0)
    reward_range: list[float] = opt([0.0, 1.0], "rewards are mapped linearly from this range to [0, 1] and clamped")
    min_group: int = opt(4, "superflow: group size of the most certain prompts", lo=2)
    max_group: int = opt(8, "superflow: group size of the most uncertain prompts", lo=2)
    bins: int = opt(4, "superflow: priority bins between min_group and max_group", lo=1)
    step_eta: float = opt(1.0, "superflow: step-level advantage eta * sigma_t * A (0 = off)", lo=0.0)


@dataclass
class CurriculumConfig:
    """AdaGRPO (algorithm.name = ada_grpo): capability-aware prompt filtering."""

    candidates: int = opt(10, "candidate prompts scored with one ODE anchor each per iteration", lo=1)
    ema_alpha: float = opt(0.8, "EMA of the anchor scores' mean and variance", lo=0.0, hi=1.0)


@dataclass
class AlgorithmConfig:
    name: str = opt("flow_grpo", choices=["flow_grpo", "flow_grpo_fast", "dance_grpo", "mix_grpo", "branch_grpo",
                                          "tempflow_grpo", "e_grpo", "chunk_grpo",
                                          "superflow", "ada_grpo"])
    group_size: int = opt(4, "samples per prompt (G); branch_grpo: leaves per tree; tempflow/e_grpo: branches "
                          "per active step and seed", lo=2)
    shared_noise: bool = opt(False, "all G samples of a prompt start from the same noise (DanceGRPO)")
    timestep_fraction: float = opt(0.99, "fraction of steps trained (flow_grpo: first int(T*f); dance: random subset)", lo=0.0, hi=1.0, lo_open=True)
    timestep_selection: str = opt("first", choices=["first", "random"])
    window: WindowConfig = field(default_factory=WindowConfig)
    tree: TreeConfig = field(default_factory=TreeConfig)
    side: SideConfig = field(default_factory=SideConfig)
    chunk: ChunkConfig = field(default_factory=ChunkConfig)
    tracker: TrackerConfig = field(default_factory=TrackerConfig)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    loss_weight: str = opt("none", "per-edge loss weight: none; TempFlow's noise-aware sigma_t sqrt(dt) normalised "
                           "to mean 1 over the trained steps; or SuperFlow's eta * sigma_t (tracker.step_eta)",
                           choices=["none", "noise_aware", "sigma_t"])
    max_batch: int = opt(64, "most tree nodes per transformer call", lo=1)


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
    kl_beta: float = opt(0.0, "KL to the reference (LoRA disabled) policy", lo=0.0)
    max_grad_norm: float = opt(1.0, lo=0.0, lo_open=True)
    num_minibatches: int = opt(1, "optimizer steps per inner epoch (trained edges split evenly)", lo=1)
    inner_epochs: int = opt(1, lo=1)
    micro_batch: int = opt(64, "most parent states per forward/backward (gradient accumulation)", lo=1)
    cfg: bool = opt(True, "apply CFG in the training forward when guidance_scale > 1")
    mixed_precision: str = opt("no", choices=["no", "fp16", "bf16"])
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
    prompt_set: str = opt("none", "a built-in prompt set instead of prompts/prompt_file",
                          choices=["none", "shapes-train", "shapes-heldout"])
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
    eval: str = opt("none", "held-out evaluation before and after training", choices=["none", "shapes"])
    eval_seeds: list[int] = opt([0, 1, 2, 3, 4, 5, 6, 7], "seeds per held-out prompt")
    eval_every: int = opt(0, "iterations between held-out curve points in eval_curve.jsonl (0 = none)", lo=0)
    eval_curve_seeds: int = opt(4, "the curve uses the first N of eval_seeds (cheaper than the full evaluation)", lo=1)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
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
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
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


def _build(cls, data: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in names:
            raise _unknown(key, cls, f"{prefix}." if prefix else "")
        value = _coerce(v, hints[k], key)
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


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load YAML (or defaults), apply overrides, validate; raises ConfigError with one clear line."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            raise ConfigError(f"{path}: invalid YAML{where}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of config sections")
    for text in overrides or []:
        data = apply_override(data, text)
    cfg = _build(Config, data)
    validate(cfg)
    return cfg


# flat presets that run all steps SDE unless algorithm.window.size > 0 restricts SDE and training to a window
WINDOWABLE = ("flow_grpo", "dance_grpo", "chunk_grpo", "superflow")


def validate(cfg: Config) -> None:
    """Cross-field checks that a single field's range cannot express."""
    t = cfg.sampler.num_steps
    w = cfg.algorithm.window
    if cfg.algorithm.name in ("mix_grpo", "flow_grpo_fast") or (cfg.algorithm.name in WINDOWABLE and w.size > 0):
        if w.size < 1:
            raise ConfigError(f"algorithm.window.size: {cfg.algorithm.name} needs a window of at least 1 step")
        end = t - 1 if w.range_end < 0 else w.range_end
        if w.size > end - (w.range_start if w.placement != "fixed" else w.start):
            raise ConfigError(f"algorithm.window.size: a window of {w.size} does not fit before step {end} of "
                              f"{t}; lower the size or raise sampler.num_steps")
    if not cfg.rewards:
        raise ConfigError("rewards: list at least one reward, e.g. rewards=[{name: jpeg_compressibility}]")
    if cfg.advantage.combine == "per_reward" and (cfg.algorithm.name in ("superflow", "ada_grpo")
                                                  or cfg.advantage.zero_variance in ("tracker", "drop_refill")):
        raise ConfigError("advantage.combine=per_reward: the prompt trackers of superflow / ada_grpo / "
                          "zero_variance tracker|drop_refill follow the summed reward; use advantage.combine=sum")
    if len(cfg.train.betas) != 2:
        raise ConfigError("train.betas: expected two numbers, e.g. [0.9, 0.999]")
    if cfg.train.kl_beta > 0 and not cfg.train.lora.enabled:
        raise ConfigError("train.kl_beta: the reference policy is the model with LoRA disabled; "
                          "enable train.lora.enabled or set train.kl_beta=0")


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
