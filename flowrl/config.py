"""Typed configuration: pydantic models loaded from YAML with ``key.sub=value`` overrides.

Every problem (unknown key, wrong type, out-of-range value) is reported before any work starts, as one
line that names the key and, for unknown keys, suggests the closest valid one. Each field carries its description,
range and choices, which ``flowrl config schema`` (JSON Schema, for editors) and ``flowrl config explain KEY`` print.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import re
import typing
from pathlib import Path
from typing import Any, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, ValidationError, field_validator

from .attention import ATTENTION_BACKENDS
from .errors import ConfigError
from .registry import DEFAULT_FAMILY


SEED_MAX = 2 ** 32 - 1  # train.seed: (seed, iteration) seeds a generator as seed * 1000003 + iteration, within 64 bits
SAMPLE_SEED_MAX = 2 ** 63 - 1  # a sample seed seeds a generator on its own


def iteration_seed(seed: int, iteration: int) -> int:
    """The seed of iteration ``iteration``'s random draws in a run with ``train.seed=seed`` (within 64 bits for
    seeds up to :data:`SEED_MAX`), so a resumed run draws what the uninterrupted one would have."""
    return seed * 1_000_003 + iteration


def check_seeds(seeds: list[int], key: str) -> None:
    """Each seed a whole number in [0, 2^63 - 1], or one line naming the first that is not."""
    bad = next((s for s in seeds if not 0 <= s <= SAMPLE_SEED_MAX), None)
    if bad is not None:
        raise ConfigError(f"{key}: seed {bad} is outside 0..{SAMPLE_SEED_MAX}; give seeds such as 0, 1, 2, 3")


def opt(default, doc: str = "", *, lo=None, hi=None, lo_open: bool = False, choices=None):
    """A field with a default, a description and optional range / choice checks (``lo_open``: > lo, not >=)."""
    extra = None
    if choices is not None:  # YAML 1.1 reads `no` as false: accelerate's documented word is "no"
        extra = {"enum": list(choices) + ([False] if "no" in choices else [])}
    bounds = {"gt" if lo_open else "ge": lo} if lo is not None else {}
    if hi is not None:
        bounds["le"] = hi
    if isinstance(default, (list, dict)):
        return Field(default_factory=lambda d=default: type(d)(d), description=doc or None, json_schema_extra=extra,
                     **bounds)
    return Field(default=default, description=doc or None, json_schema_extra=extra, **bounds)


class Section(BaseModel):
    """A config section: unknown keys, wrong types (no silent conversion: 2.5 is not an integer, 1 is not true)
    and non-finite numbers are refused; a string written as a number (YAML 1.1 reads ``1e-4`` as text) is one."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _yaml_spellings(cls, value, info):
        field = cls.model_fields[info.field_name]
        choices = _choices(field)
        if isinstance(value, bool) and choices and ("yes" if value else "no") in choices:
            return "yes" if value else "no"
        if isinstance(value, str) and _expects_number(field.annotation):
            try:
                number = float(value)
            except ValueError:
                return value
            if not math.isfinite(number):  # nan passes every range check (nan < lo is false)
                raise ValueError(f"{value!r} is not a finite number")
            return number
        return value

    @field_validator("*", mode="after")
    @classmethod
    def _one_of_the_choices(cls, value, info):
        choices = _choices(cls.model_fields[info.field_name])
        if choices is not None and value is not None and value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"{value!r} is not one of {', '.join(map(str, choices))}{hint}")
        return value


def _choices(field) -> list | None:
    """A field's choices (its schema's enum, less the ``false`` that YAML 1.1 makes of ``no``)."""
    if not isinstance(field.json_schema_extra, dict) or "enum" not in field.json_schema_extra:
        return None
    return [c for c in field.json_schema_extra["enum"] if c is not False]


def _expects_number(tp) -> bool:
    return tp is float or (typing.get_origin(tp) is typing.Union and float in typing.get_args(tp))


class TinyModelConfig(Section):
    resolution: int = opt(16, "image size in pixels", lo=8)
    vae: bool = opt(False, "build a tiny AutoencoderKL (latent space) instead of pixel space")
    patch_size: int = opt(2, "pixels (or latent cells) per token side", lo=1)
    num_layers: int = opt(2, "transformer blocks", lo=1)
    num_attention_heads: int = opt(2, "attention heads per block", lo=1)
    attention_head_dim: int = opt(32, "width of one attention head", lo=8)
    text_hidden: int = opt(32, "hidden size of each tiny CLIP text encoder", lo=8)
    text_projection: int = opt(32, "width of the text encoders' pooled projection", lo=8)
    text_layers: int = opt(2, "layers of each tiny text encoder", lo=1)
    max_tokens: int = opt(16, "tokenizer length of the tiny text encoders", lo=4)
    shift: float = opt(1.0, "scheduler shift of the tiny model", lo=0.0, lo_open=True)
    init_seed: int = opt(0, "seed of the random initialisation", lo=0, hi=SEED_MAX)
    experts: int = opt(1, "wan only: 2 builds Wan 2.2 A14B's layout, a high-noise and a low-noise transformer",
                       choices=[1, 2])


class ModelConfig(Section):
    family: str = opt(DEFAULT_FAMILY, "model family: sd3 (SD3 / SD3.5), flux (FLUX.1 dev / schnell), flux2 (FLUX.2 dev / "
                      "klein), qwenimage (Qwen-Image), zimage (Z-Image / Z-Image-Turbo), flux-kontext (FLUX.1 Kontext), qwenimage-edit (Qwen-Image-Edit) and qwenimage-edit-plus (Qwen-Image-Edit-2509 / 2511, up to three sources) image editing (data rows need a source image), wan (Wan 2.1 / 2.2 text-to-video), hunyuanvideo15 (HunyuanVideo 1.5 text-to-video), ltx2 (LTX-2 text-to-video; its audio stream is denoised alongside, not trained or decoded), a "
                      "family registered with "
                      "flowrl.registry.register_model_family, or module:Class of a plug-in adapter")
    num_frames: int = opt(17, "video frames (wan, hunyuanvideo15, ltx2): 4k + 1 for the 4x temporal compression of Wan and HunyuanVideo 1.5, 8k + 1 for LTX-2's 8x", lo=1)
    pretrained: Optional[str] = opt("tiny", "'tiny' (random init), 'tiny-shapes' / 'tiny-moving-shapes' / "
                                    "'tiny-shapes-edit' (the shipped pretrained image / video / editing models), a "
                                    "preset (sd3.5-medium, sd3.5-large), a hub id or a local diffusers folder")
    dtype: str = opt("fp32", "weights dtype of the transformer", choices=["fp32", "bf16", "fp16"])
    resolution: int = opt(16, "image resolution in pixels", lo=8)
    use_t5: bool = opt(True, "load the T5 encoder of real SD3 checkpoints")
    max_sequence_length: int = opt(256, "text tokens of a real checkpoint's prompt encoder (T5: FLUX.1-dev uses 512; LTX-2's "
                                   "Gemma 3: 1024)", lo=0, hi=1024)
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
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)


    @field_validator("family")
    @classmethod
    def _a_known_family(cls, value):
        return _known_family(value)


def _known_family(value: str) -> str:
    from .registry import MODEL_FAMILIES

    known = MODEL_FAMILIES.names()  # built-in, registered and installed
    if value not in known and ":" not in value:
        close = difflib.get_close_matches(value, known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"{value!r} is not one of {', '.join(known)}{hint} (or module:Class of a plug-in)")
    return value


class PoolConfig(Section):
    size: int = opt(0, "candidates per prompt scored by a cheap ODE rollout before the real one, whose initial noises "
                    "are chosen among them (Sol-RL's exploration pool; 0: off); at least the plan's roots per prompt",
                    lo=0)
    select: str = opt("best_worst", "which candidates the real rollout regenerates: best_worst (half from the top and "
                      "half from the bottom of the cheap rewards, Sol-RL's), best, or random (a control)",
                      choices=["best_worst", "best", "random"])
    num_steps: int = opt(6, "ODE steps of the cheap rollout (Sol-RL: 6, the real rollout 10)", lo=1)
    precision: str = opt("bf16", "the cheap rollout's arithmetic: bf16 (autocast on the device), int8 (dynamic int8 "
                         "linear layers, CPU), fp8 (float8 linear layers on GPUs of compute capability 8.9+; Sol-RL "
                         "explores in NVFP4 on Blackwell GPUs) or fp32 (the model's own dtype, fewer steps only)",
                         choices=["bf16", "int8", "fp8", "fp32"])
    guidance_scale: Optional[float] = opt(None, "CFG of the cheap rollout (null: the sampler's; Sol-RL: 1, off)",
                                          lo=0.0)


class SamplerConfig(Section):
    num_steps: int = opt(10, "denoising steps of the rollout", lo=1)
    schedule: str = opt("diffusers", "sigma grid", choices=["diffusers", "static_shift", "dynamic_shift"])
    shift: float = opt(3.0, "shift for static_shift", lo=0.0, lo_open=True)
    kernel: str = opt("flow_grpo", "SDE step kernel: flow_grpo (g = a sqrt(sigma / (1 - sigma))), dance (g = eta), "
                      "cps (coefficients-preserving), flash (g = a sigma_1 sigma, Flash-GRPO's)",
                      choices=["flow_grpo", "dance", "cps", "flash"])
    noise_level: float = opt(0.7, "a for flow_grpo/cps, eta for dance (published settings lie in 0.3..1)", lo=0.0,
                             hi=2.0)
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
    pool: PoolConfig = Field(default_factory=PoolConfig)


class AlgorithmOptions(Section):
    """What every algorithm's options share: its registered name. Each algorithm module defines its own
    ``Options`` subclass (flowrl/algorithms); ``algorithm:`` in a config accepts only that algorithm's keys."""

    name: str = opt("flow_grpo", "a registered algorithm (flowrl/algorithms) or module:Class of a plug-in")


class AdvantageConfig(Section):
    std: str = opt("group", "normalise by each group's std or the batch's", choices=["group", "global"])
    ddof: int = opt(0, "0 = numpy std (Flow-GRPO), 1 = torch.std (DanceGRPO)", lo=0, hi=1)
    eps: float = opt(1e-4, "added to the std before dividing (A = (r - mean) / (std + eps))", lo=0.0)
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


class LoraConfig(Section):
    enabled: bool = opt(True, "LoRA through peft; false = full fine-tuning")
    rank: int = opt(8, "LoRA rank r", lo=1)
    alpha: float = opt(16.0, "LoRA alpha (the update is scaled by alpha / r)", lo=0.0, lo_open=True)
    targets: list[str] = opt([], "module names; empty = the model family's defaults")


class EmaConfig(Section):
    enabled: bool = opt(False, "keep an exponential moving average of the trained weights")
    decay: float = opt(0.9, "EMA <- decay EMA + (1 - decay) weights", lo=0.0, hi=1.0)
    update_every: int = opt(1, "optimizer steps between EMA updates", lo=1)


class ContextParallelConfig(Section):
    ulysses: int = opt(1, "Ulysses degree: each sample's tokens split over this many processes, attention heads "
                       "exchanged by all-to-all (diffusers' context parallelism: FLUX.1, FLUX.2, Qwen-Image, Wan). "
                       "Groups of ulysses x ring consecutive processes share each sample", lo=1)
    ring: int = opt(1, "ring-attention degree: key/value blocks passed round a ring of this many processes", lo=1)

    @property
    def degree(self) -> int:
        return self.ulysses * self.ring


class FSDPConfig(Section):
    enabled: bool = opt(False, "shard the transformer's weights, gradients and optimizer state over the processes "
                        "(torch FSDP2, one shard group per node, or per train.fsdp.shard_size processes)")
    shard_size: int = opt(0, "processes one copy of the weights is sharded over; 0 = all of them (FSDP). Smaller "
                          "divides the world into replicas: HSDP, replicate across nodes and shard within one "
                          "(2 nodes x 8 GPUs: 8)", lo=0)
    reshard_after_forward: bool = opt(True, "free the gathered weights after each block's forward (least memory; "
                                      "false keeps them to the backward: less communication)")
    cpu_offload: bool = opt(False, "keep the sharded weights, gradients and optimizer state in host memory")
    resume_other_world_size: bool = opt(False, "allow resuming a sharded checkpoint at another number of processes "
                                        "(continues equal up to float reduction order, not bit for bit)")


class TrainConfig(Section):
    iterations: int = opt(30, "rollout + update iterations (the most a run takes; a budget may end it sooner)", lo=1)
    budget_evaluations: int = opt(0, "end the run once it has spent this many transformer evaluations (rollout "
                                  "and update, every sample through a forward; 0 = no budget): methods compared at "
                                  "equal compute", lo=0)
    budget_seconds: float = opt(0.0, "end the run once its iterations have taken this many seconds (0 = no budget)",
                                lo=0.0)
    prompts_per_iter: int = opt(4, "distinct prompts (groups) per iteration", lo=1)
    lr: float = opt(3e-4, "AdamW's peak learning rate (train.lr_schedule shapes it over the iterations)", lo=0.0,
                    lo_open=True)
    lr_schedule: str = opt("constant", "the learning rate per iteration: constant, linear (down to 0 at "
                           "train.iterations) or cosine (down to 0), each after train.warmup_iterations of linear "
                           "warmup; a function of the iteration, so a resume continues it exactly",
                           choices=["constant", "linear", "cosine"])
    warmup_iterations: int = opt(0, "iterations of linear warmup from lr / warmup_iterations up to lr", lo=0)
    betas: list[float] = opt([0.9, 0.999], "AdamW betas, two numbers in [0, 1)")
    weight_decay: float = opt(1e-4, "AdamW decoupled weight decay", lo=0.0)
    adam_eps: float = opt(1e-8, "AdamW epsilon", lo=0.0, lo_open=True)
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
    max_grad_norm: float = opt(1.0, "clip the gradient's global norm to this before each step", lo=0.0, lo_open=True)
    num_minibatches: int = opt(1, "optimizer steps per inner epoch (trained edges split evenly)", lo=1)
    inner_epochs: int = opt(1, "passes over one iteration's rollouts (ratios move from 1 after the first)", lo=1)
    micro_batch: typing.Union[typing.Annotated[int, Field(ge=1)], typing.Literal["auto"]] = opt(
        64, "most parent states per forward/backward (gradient accumulation); auto: the largest that fits the "
        "device's memory by flowrl memory's estimate, chosen once and kept in the run folder (micro_batch.json), "
        "so a resume uses it again")
    update_composition: str = opt(
        "micro_batch", "how the update batches the states it recomputes: micro_batch (train.micro_batch states per "
        "forward, the fewest forwards) or rollout (each state in the very transformer call of the rollout that "
        "evaluated it, the same rows in the same order, so that the first update's ratio is 1 where kernels depend "
        "on the batch, as bf16 matmuls on a GPU do; every row of a touched call is recomputed)",
        choices=["micro_batch", "rollout"])
    cfg: bool = opt(True, "apply CFG in the training forward when guidance_scale > 1")
    cfg_unconditional_grad: bool = opt(False, "with train.cfg: also back-propagate through the unconditional "
                                       "(negative-prompt) half of CFG. Left out, each method's published choice: "
                                       "false for Flow-GRPO and the methods built on its update (that half is a "
                                       "constant, computed without autograd), true for GARDO and TempFlow-GRPO, "
                                       "whose released updates keep it")
    mixed_precision: str = opt("no", "autocast of the transformer's forward; latents, SDE maths and trainable weights "
                               "stay fp32", choices=["no", "fp16", "bf16"])
    optimizer: str = opt("adamw", "adamw (fused on CUDA) or adamw_8bit (bitsandbytes, CUDA)",
                         choices=["adamw", "adamw_8bit"])
    fused_loss: bool = opt(False, "the per-edge log-prob, ratio, clip and KL as one torch.compile'd function "
                           "(equals the eager path; for per-edge algorithms)")
    compile_transformer: bool = opt(False, "torch.compile the transformer's repeated blocks")
    gradient_checkpointing: bool = opt(False, "recompute block activations in the backward (memory for time)")
    attention_backend: str = opt("native", "attention kernels of the rollout and the update: " + "; ".join(
        f"{name}: {what}" for name, what in ATTENTION_BACKENDS.items()), choices=list(ATTENTION_BACKENDS))
    log_prob_reduce: str = opt("mean", "mean over latent elements (Flow-GRPO's and DanceGRPO's convention) or sum",
                               choices=["mean", "sum"])
    lora: LoraConfig = Field(default_factory=LoraConfig)
    ema: EmaConfig = Field(default_factory=EmaConfig)
    peak_tflops: Optional[float] = opt(None, "the device's dense bf16 peak in TFLOP/s for the MFU in the metrics; "
                                       "default: a table of known GPUs (H100/H200 989, A100 312, ...), none on CPUs",
                                       lo=0.0, lo_open=True)
    fsdp: FSDPConfig = Field(default_factory=FSDPConfig)
    context_parallel: ContextParallelConfig = Field(default_factory=ContextParallelConfig)
    seed: int = opt(0, "every random draw comes from a generator seeded by (seed, iteration)", lo=0, hi=SEED_MAX)


class RewardSpec(Section):
    name: str = opt("jpeg_compressibility", "registered name or module:function")
    weight: float = opt(1.0, "the reward's weight in the sum (or in the sum of advantages with "
                             "advantage.combine=per_reward)")
    args: dict[str, Any] = opt({}, "keyword arguments for the reward's constructor")


class DataConfig(Section):
    prompts: list[str] = opt([], "training prompts (or use prompt_file)")
    prompt_file: Optional[str] = opt(None, ".txt (one per line) or .jsonl with a 'prompt' field")
    prompt_set: str = opt("none", "a registered prompt set instead of prompts/prompt_file (shapes-train, "
                          "shapes-heldout) or module:function")
    dataset: Optional[str] = opt(None, "a Hugging Face dataset of prompts: a local .parquet / .jsonl / .json / .csv / "
                                 ".arrow file, a folder (save_to_disk, or data files), or a hub id")
    split: str = opt("train", "data.dataset: the split to read")
    prompt_column: str = opt("prompt", "data.dataset: the column holding the prompt")
    metadata_columns: list[str] = opt([], "data.dataset: columns kept as each prompt's metadata (empty: all others)")
    sample_prompts: list[str] = opt([], "prompts of the sample grids (default: the first training prompts)")
    sample_seeds: list[int] = opt([0, 1, 2, 3], "seeds of the sample grids written during training")


class LogConfig(Section):
    output_dir: str = opt("runs", "parent folder of run directories")
    run_name: Optional[str] = opt(None, "run folder name, one folder inside log.output_dir (default: config name + "
                                  "time)")
    sample_every: int = opt(10, "iterations between sample grids (0 = only start and end)", lo=0)
    save_every: int = opt(10, "iterations between checkpoints (0 = only at the end)", lo=0)
    keep_checkpoints: int = opt(2, "newest checkpoints kept in the run folder (older ones are deleted; "
                                   "checkpoints/best stays)", lo=1)
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
    stop_without_signal: int = opt(5, "stop, in one line, after this many iterations in a row in which every "
                                   "group's rewards were equal (nothing to learn); 0 = never", lo=0)
    early_stop_patience: int = opt(0, "stop after this many curve points in a row without a new best (0 = never)",
                                   lo=0)
    early_stop_drop: float = opt(0.0, "stop when a curve point falls this far below the best (e.g. 0.1 = 10 "
                                 "points of accuracy; 0 = never)", lo=0.0)

    @field_validator("run_name")
    @classmethod
    def _one_folder_name(cls, value):
        """A name, not a path: it must not leave log.output_dir nor name it."""
        if value and (value in (".", "..") or any(c in value for c in "/\\\0") or value != value.strip()):
            raise ValueError(f"{value!r} is not a folder name; give one name without '/', '\\', '..' or surrounding "
                             "spaces (the run goes in log.output_dir/<run_name>; set log.output_dir for another place)")
        if value and len(value.encode()) > 200:  # file systems allow 255 bytes; the run adds suffixes to it
            raise ValueError(f"{len(value.encode())} bytes is too long for a folder name; give at most 200")
        return value


class GuardConfig(Section):
    """The reward-hacking guard (flowrl/guard.py): held-out samples every ``every`` iterations, measured against the
    run's start."""

    enabled: bool = opt(True, "watch for reward hacking every guard.every iterations (a run with fewer iterations "
                        "has no check and measures nothing)")
    every: int = opt(25, "iterations between checks", lo=1)
    prompts: list[str] = opt([], "the guard's held-out prompts (empty: the first guard.num_prompts of guard.prompt_set, "
                             "else of the training prompts)")
    prompt_set: str = opt("", "a registered prompt set the guard's prompts come from (e.g. shapes-heldout)")
    num_prompts: int = opt(4, "prompts taken from guard.prompt_set or the training prompts", lo=1)
    seeds: list[int] = opt([0, 1, 2, 3], "seeds per prompt (diversity compares one prompt's samples)")
    watched: list[RewardSpec] = opt([], "rewards the run does not train on, each watched against its starting value "
                                    "(a PickScore run: hpsv2, imagereward, aesthetic, clip)")
    watched_tolerance: float = opt(3.0, "a watched reward may fall this many standard errors of its starting mean "
                                   "(the spread of the guard's samples / sqrt(their number))", lo=0.0, lo_open=True)
    diversity_embedder: str = opt("", "a vision backbone for diversity (a folder or hub id of a transformers image "
                                  "model, as GARDO's, or tiny-clip: the shipped shapes CLIP); empty: the images "
                                  "downsampled to 32 x 32")
    diversity_drop: float = opt(0.5, "diversity may fall to (1 - this) of its start", lo=0.0, hi=1.0)
    artifact_rise: float = opt(0.5, "the periodic-artifact score (log power ratio at the patch period) may rise this "
                               "much", lo=0.0, lo_open=True)
    drift: float = opt(0.15, "mean brightness, saturation and the dark / blown-out fractions may move this much "
                       "(absolute, on a 0..1 scale)", lo=0.0, lo_open=True)
    on_trigger: str = opt("warn", "warn (one line, the run goes on), stop, or restore_best (stop with the weights of "
                          "the last check at which every signal held, or the held-out best point before it)",
                          choices=["warn", "stop", "restore_best"])


class Config(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    algorithm: SerializeAsAny[AlgorithmOptions] = Field(default_factory=AlgorithmOptions)
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    rewards: list[RewardSpec] = Field(default_factory=lambda: [RewardSpec()])
    data: DataConfig = Field(default_factory=DataConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    guard: GuardConfig = Field(default_factory=GuardConfig)
    resume: Optional[str] = opt(None, "'latest' or a checkpoint folder to resume from")
    device: str = opt("auto", "where to train: auto (cuda when available)", choices=["auto", "cpu", "cuda"])

    @field_validator("algorithm", mode="before")
    @classmethod
    def _the_named_algorithms_options(cls, value):
        return build_algorithm(value)


# --------------------------------------------------------------------------------------------- parsing


def _section_type(tp):
    """The Section class a field holds (directly, in a list or optional), else None."""
    for t in (tp, *typing.get_args(tp)):
        if isinstance(t, type) and issubclass(t, Section):
            return t
    return None


def _all_keys(cls, prefix="") -> list[str]:
    keys = []
    for name, f in cls.model_fields.items():
        keys.append(f"{prefix}{name}")
        sub = _section_type(f.annotation)
        if sub is not None and typing.get_origin(f.annotation) is not list:
            keys += _all_keys(sub, f"{prefix}{name}.")
    return keys


def _unknown(key: str, cls, prefix: str) -> ConfigError:
    close = difflib.get_close_matches(key, _all_keys(cls, prefix), n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"unknown config key {key!r}{hint}")


def _type_name(tp) -> str:
    if typing.get_origin(tp) is typing.Union:
        args = typing.get_args(tp)
        names = " or ".join(_type_name(a) for a in args if a is not type(None))
        return names + (" or null" if type(None) in args else "")
    if typing.get_origin(tp) is typing.Annotated:
        return _type_name(typing.get_args(tp)[0])
    if typing.get_origin(tp) is typing.Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if typing.get_origin(tp) is dict:
        return "mapping"
    return getattr(tp, "__name__", str(tp))


_EXPECTED = {"int": "an integer", "bool": "true or false", "float": "a number", "string": "a string",
             "dict": "a mapping"}


def _one_line(exc: ValidationError, cls, prefix: str) -> ConfigError:
    """The first problem pydantic found, as the one line flowrl prints (the key, what was wrong, what to write)."""
    err = exc.errors(include_url=False)[0]
    # ('train', 'lr') or ('rewards', 0, 'name') -> train.lr, rewards[0].name; a union's branch tags dropped
    loc = tuple(p for p in err["loc"] if isinstance(p, int) or not (p.startswith(("constrained-", "literal[")) or
                                                                   p in ("int", "str", "float", "bool")))
    key = prefix
    for part in loc:
        key += f"[{part}]" if isinstance(part, int) else (f".{part}" if key else str(part))
    kind, value, ctx = err["type"], err.get("input"), err.get("ctx", {})
    if kind == "extra_forbidden":
        return _unknown(key, cls, f"{prefix}." if prefix else "")
    if kind == "value_error":  # the messages of flowrl's own checks (choices, text that reads as a number)
        return ConfigError(f"{key}: {str(ctx.get('error', err['msg']))}")
    if kind == "finite_number":
        return ConfigError(f"{key}: {value!r} is not a finite number")
    bounds = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"), "less_than_equal": ("<=", "le")}
    if kind in bounds:
        sign, name = bounds[kind]
        return ConfigError(f"{key}: {value!r} is out of range; it must be {sign} {ctx[name]}")
    field = _field_at(cls, loc)
    if kind in ("model_type", "model_attributes_type"):
        section = _section_type(field.annotation) if field is not None else None
        return ConfigError(f"{key}: expected a mapping of {section.__name__ if section else 'section'} fields, got "
                           f"{value!r}")
    if kind == "list_type":
        return ConfigError(f"{key}: expected {_type_name(field.annotation) if field else 'a list'}, got {value!r}")
    base = kind.split("_")[0]
    if field is not None and any(typing.get_origin(a) is typing.Literal for a in typing.get_args(field.annotation)):
        return ConfigError(f"{key}: expected {_type_name(field.annotation)}, got {value!r}")  # a number or a word
    return ConfigError(f"{key}: expected {_EXPECTED.get(base, base)}, got {value!r}")


def _field_at(cls, loc):
    """The field the error location ends in (list indices skipped), or None."""
    field = None
    for part in loc:
        if isinstance(part, int) or cls is None:
            continue
        field = cls.model_fields.get(part)
        cls = _section_type(field.annotation) if field is not None else None
    return field


def _build(cls, data, prefix: str = ""):
    """A section from its mapping, or one ConfigError naming the first problem."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping of {cls.__name__} fields, got {data!r}")
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise _one_line(exc, cls, prefix) from None


def build_algorithm(value, key: str = "algorithm"):
    """The ``algorithm`` section: its ``name`` picks the registered algorithm, whose ``Options`` model then
    takes the remaining keys (only that algorithm's)."""
    from .registry import algorithm_class

    if isinstance(value, AlgorithmOptions):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected a mapping such as {{name: flow_grpo, group_size: 8}}, got {value!r}")
    name = value.get("name", AlgorithmOptions.model_fields["name"].default)
    if not isinstance(name, str):
        raise ConfigError(f"{key}.name: expected a string, got {name!r}")
    options = algorithm_class(name).Options
    unknown = [k for k in value if k not in options.model_fields]
    if unknown:
        k = unknown[0]
        valid = ", ".join(f for f in options.model_fields if f != "name")
        close = difflib.get_close_matches(str(k), list(options.model_fields), n=1)
        hint = f"did you mean {key}.{close[0]!r}? " if close else ""
        raise ConfigError(f"{key}.{k}: not an option of {name}; {hint}its options: {valid}")
    return _build(options, {**value, "name": name}, key)


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
    if cfg.data.dataset and any(cfg.data.dataset.endswith(s) for s in (".parquet", ".jsonl", ".json", ".csv", ".arrow")):
        cfg.data.dataset = str(_resolve_data_path(cfg.data.dataset, path))  # a file: found as prompt files are
    return validate(cfg)


def _resolve_data_path(name: str, config_path: Path | None) -> Path:
    """A relative data path as written in a config: from the current folder, else beside the config file, else
    in the shipped assets (``assets/prompts/animals.txt``), so a preset runs from any folder."""
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


def resolved(cfg: Config) -> Config:
    """The config with its method's published defaults where it leaves those keys out (a key the config sets
    wins): the advantage settings of the released code (BranchGRPO's ddof 1, eps 1e-8) and whether the update
    back-propagates through CFG's unconditional half. A copy; ``cfg`` is left as it is."""
    from .registry import algorithm_class

    method = algorithm_class(cfg.algorithm.name)
    advantage = {k: v for k, v in getattr(method, "advantage_defaults", {}).items()
                 if k not in cfg.advantage.model_fields_set}
    train = ({} if "cfg_unconditional_grad" in cfg.train.model_fields_set
             else {"cfg_unconditional_grad": bool(getattr(method, "cfg_unconditional_grad", False))})
    return cfg.model_copy(update={"advantage": cfg.advantage.model_copy(update=advantage),
                                  "train": cfg.train.model_copy(update=train)})


def validate(cfg: Config) -> Config:
    """Cross-field checks that a single field's range cannot express, the algorithm's own among them: all of
    them run here, at load, before a model is loaded or a file written. Returns the config resolved
    (:func:`resolved`); ``cfg`` itself is not changed."""
    from .registry import algorithm_class

    cfg = resolved(cfg)
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
    if cfg.rewards and all(r.weight == 0 for r in cfg.rewards):
        raise ConfigError("rewards: every reward has weight 0, so the run has nothing to learn from; give one a "
                          "non-zero weight (rewards[0].weight=1)")
    for key, seeds in (("data.sample_seeds", cfg.data.sample_seeds), ("log.eval_seeds", cfg.log.eval_seeds)):
        if not seeds:
            raise ConfigError(f"{key}: list at least one seed, e.g. [0, 1, 2, 3]")
        check_seeds(seeds, key)
    if cfg.guard.enabled:
        check_seeds(cfg.guard.seeds, "guard.seeds")
        if len(set(cfg.guard.seeds)) < 2:
            raise ConfigError(f"guard.seeds: {cfg.guard.seeds} gives each prompt fewer than two samples, so the "
                              "guard's diversity signal could not see a collapse; list at least two seeds, e.g. "
                              "[0, 1, 2, 3]")
        if cfg.guard.prompt_set and cfg.guard.prompts:
            raise ConfigError("guard.prompts and guard.prompt_set both name the guard's prompts; keep one")
    m = cfg.model
    from .registry import MODEL_NAMES, adapter_class

    # an embedded model's adapter checks its exact geometry at load; otherwise the family's own rule
    factor = 1 if m.pretrained in MODEL_NAMES else adapter_class(m.family).resolution_multiple(m)
    if m.resolution % factor:
        lo = m.resolution - m.resolution % factor
        raise ConfigError(f"model.resolution: {m.resolution} px is not a multiple of {factor} (the latent patch "
                          f"grid of this model); use {lo or factor} or {lo + factor}")
    frames = None if m.pretrained in MODEL_NAMES else adapter_class(m.family).frames_multiple(m)
    if frames and (m.num_frames - 1) % frames:
        lo = m.num_frames - (m.num_frames - 1) % frames
        raise ConfigError(f"model.num_frames: {m.num_frames} frames is not {frames}k + 1 (the VAE's {frames}x temporal "
                          f"compression); use {lo} or {lo + frames}")
    for key, value, package, extra in (("train.optimizer", cfg.train.optimizer == "adamw_8bit", "bitsandbytes", "bitsandbytes"),
                                       ("train.attention_backend", cfg.train.attention_backend == "xformers", "xformers",
                                        "xformers"),
                                       ("train.attention_backend", cfg.train.attention_backend == "flash", "flash_attn",
                                        "flash-attn")):
        if value and importlib.util.find_spec(package) is None:
            raise ConfigError(f"{key}: needs the {extra} package (pip install 'flowrl-tree[{extra}]' or pip install "
                              f"{extra}); or set it back to its default")
    if cfg.train.update_composition == "rollout":
        for key, bad, fix in (("train.fsdp.enabled", cfg.train.fsdp.enabled, "train.fsdp.enabled=false"),
                              ("train.context_parallel.degree", cfg.train.context_parallel.degree > 1,
                               "train.context_parallel.degree=1"),
                              ("train.cfg", cfg.sampler.guidance_scale > 1 and not cfg.train.cfg, "train.cfg=true")):
            if bad:
                raise ConfigError(f"train.update_composition=rollout: recomputing the rollout's calls needs the "
                                  f"update to call the transformer as the rollout did, which {key} prevents; set "
                                  f"{fix} or train.update_composition=micro_batch")
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
    algorithm_class(cfg.algorithm.name).validate(cfg)  # the universal checks, then the algorithm's own
    return cfg


def to_dict(cfg) -> dict:
    """The resolved config as plain data; the algorithm section holds only its own algorithm's options."""
    return cfg.model_dump()


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


# --------------------------------------------------------------------------------------------- schema
def json_schema() -> dict:
    """The JSON Schema of a config file (draft 2020-12), from the models: editors complete and check YAML with it
    (``# yaml-language-server: $schema=flowrl.schema.json``). Each key carries its description, default, range
    and choices; ``algorithm`` is one alternative per registered algorithm, chosen by its ``name``."""
    from .registry import ALGORITHMS, algorithm_class

    schema = Config.model_json_schema()
    defs = schema.setdefault("$defs", {})
    defs.pop("AlgorithmOptions", None)
    name_doc = AlgorithmOptions.model_fields["name"].description
    alternatives = []
    for name in ALGORITHMS.names():
        alt = algorithm_class(name).Options.model_json_schema()
        defs.update(alt.pop("$defs", {}))
        alt["title"] = name
        alt["properties"]["name"] = {"const": name, "description": name_doc}
        alt["required"] = [] if name == AlgorithmOptions.model_fields["name"].default else ["name"]
        alternatives.append(alt)
    schema["properties"]["algorithm"] = {"description": "the algorithm (name) and its own options",
                                         "oneOf": alternatives}
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


def explain(key: str) -> str:
    """A key's type, default, range or choices and description, for ``flowrl config explain KEY``."""
    from .registry import ALGORITHMS, algorithm_class

    cls, parts, owner = Config, key.split("."), ""
    for depth, part in enumerate(parts):
        if cls is AlgorithmOptions:  # the options of the algorithms that have this key (the default one first)
            default = AlgorithmOptions.model_fields["name"].default
            names = sorted(ALGORITHMS.names(), key=lambda n: n != default)
            having = [n for n in names if part in algorithm_class(n).Options.model_fields]
            if not having:
                raise ConfigError(f"{key}: no algorithm has the option {part!r} (see `flowrl config schema`)")
            cls = algorithm_class(having[0]).Options
            owner = f" (an option of {', '.join(having)})" if part != "name" else ""
        field = cls.model_fields.get(part) if cls is not None else None
        if field is None:
            raise _unknown(key, Config, "")
        cls = _section_type(field.annotation) if typing.get_origin(field.annotation) is not list else None
        if depth < len(parts) - 1 and cls is None:
            raise _unknown(key, Config, "")
    if cls is not None:
        return f"{key}: a section with keys {', '.join(cls.model_fields)}"
    default = field.get_default(call_default_factory=True)
    if isinstance(default, list):
        default = [d.model_dump() if isinstance(d, BaseModel) else d for d in default]
    lines = [f"{key}{owner}", f"  type: {_type_name(field.annotation)}",
             f"  default: {yaml.safe_dump(default, default_flow_style=True).strip().removesuffix('...').strip()}"]
    choices = _choices(field)
    if choices is not None:
        lines.append(f"  choices: {', '.join(map(str, choices))}")
    bounds = [f"{sign} {getattr(m, attr)}" for m in field.metadata
              for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<=")) if hasattr(m, attr)]
    if bounds:
        lines.append(f"  range: {' and '.join(bounds)}")
    if field.description:
        lines.append(f"  {field.description}")
    by_method = method_defaults(key)
    if by_method:  # what each method uses where a config leaves the key out
        values: dict[str, list[str]] = {}
        for name, v in sorted(by_method.items()):
            values.setdefault(yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip(),
                              []).append(name)
        lines.append("  left out, each method's value (its published choice where the package read one): "
                     + "; ".join(f"{v}: {', '.join(names)}" for v, names in values.items()))
    return "\n".join(lines)


def method_defaults(key: str) -> dict:
    """The value each registered method puts in ``key`` where a config leaves it out (its published choice):
    ``train.cfg_unconditional_grad`` and the ``advantage`` settings a method's released code fixes."""
    from .registry import ALGORITHMS, algorithm_class

    out = {}
    for name in ALGORITHMS.names():
        cls = algorithm_class(name)
        if key == "train.cfg_unconditional_grad":
            out[name] = bool(getattr(cls, "cfg_unconditional_grad", False))
        elif key.startswith("advantage.") and key.split(".", 1)[1] in getattr(cls, "advantage_defaults", {}):
            out[name] = cls.advantage_defaults[key.split(".", 1)[1]]
    return out


# --------------------------------------------------------------------------------------------- reference
def reference_fields() -> list[tuple[str, str]]:
    """Every leaf key a config file can set, as (table, dotted key): the sections' keys under their section
    (``rewards[].name`` for list entries) and each registered algorithm's own options under ``algorithm
    (<name>)``. The configuration reference prints exactly one row per entry."""
    from .registry import ALGORITHMS, algorithm_class

    rows: list[tuple[str, str]] = []

    def walk(cls, prefix: str, table: str, nested_table: bool):
        for name, f in cls.model_fields.items():
            sub = _section_type(f.annotation)
            if cls is Config and name == "algorithm":
                continue
            if sub is not None:
                is_list = typing.get_origin(f.annotation) is list
                key = f"{prefix}{name}{'[]' if is_list else ''}"
                walk(sub, key + ".", key.replace("[]", "") if nested_table else table, nested_table)
            else:
                rows.append((table, f"{prefix}{name}"))

    walk(Config, "", "top level", True)
    for name in sorted(ALGORITHMS):  # an algorithm's sub-sections (a window) stay in its one table
        walk(algorithm_class(name).Options, "algorithm.", f"algorithm ({name})", False)
    return rows


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def reference_markdown(only_table: str | None = None) -> str:
    """The configuration reference as Markdown: one table per section (and per algorithm), one row per key with
    its type, default, range or choices and description, read from the schema itself, so it cannot drift.

    Args:
        only_table: one table's name (``train``, ``algorithm (branch_grpo)``); None for all of them.
    Returns:
        Markdown text with a ``###`` heading and a table per section.
    """
    from .registry import algorithm_class

    tables: dict[str, list[str]] = {}  # a section's keys in one table, even where a sub-section comes between them
    for table, key in reference_fields():
        if only_table is not None and table != only_table:
            continue
        rows = tables.setdefault(table, [])
        owner = Config
        parts = key.replace("[]", "").split(".")  # rewards[].name -> rewards, name
        if table.startswith("algorithm ("):
            owner, parts = algorithm_class(table[len("algorithm ("):-1]).Options, parts[1:]
        for part in parts[:-1]:
            owner = _section_type(owner.model_fields[part].annotation)
        field = owner.model_fields[parts[-1]]
        default = field.get_default(call_default_factory=True)
        if isinstance(default, list):
            default = [d.model_dump() if isinstance(d, BaseModel) else d for d in default]
        default_text = yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("...").strip()
        if table.startswith("algorithm (") and key == "algorithm.name":
            default_text = table[len("algorithm ("):-1]  # the name that selects this table's algorithm
        choices = _choices(field)
        bounds = [f"{sign} {getattr(m, attr)}" for m in field.metadata
                  for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<=")) if hasattr(m, attr)]
        limit = ", ".join(map(str, choices)) if choices is not None else " and ".join(bounds)
        rows.append(f"| `{key}` | {_cell(_type_name(field.annotation))} | `{_cell(default_text)}` | {_cell(limit)} | "
                    f"{_cell(field.description or '')} |")
    out = []
    for table, rows in tables.items():
        if only_table is None:
            out.append(f"\n### `{table}`\n" if table != "top level" else "\n### top level\n")
        out += ["| key | type | default | range or choices | description |", "|---|---|---|---|---|", *rows]
    return "\n".join(out).lstrip("\n") + "\n"
