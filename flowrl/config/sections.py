"""The config's sections (model, sampler, algorithm, advantage, train, rewards, data, log, guard) and the
whole :class:`Config`; an algorithm's own options come from its registered ``Options`` model."""

from __future__ import annotations

import difflib
import typing
from typing import Any, Optional

from pydantic import Field, SerializeAsAny, field_validator

from ..attention import ATTENTION_BACKENDS
from ..errors import ConfigError
from ..registry import DEFAULT_FAMILY
from .base import SEED_MAX, Section, _build, opt


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
    from ..registry import MODEL_FAMILIES

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


def build_algorithm(value, key: str = "algorithm"):
    """The ``algorithm`` section: its ``name`` picks the registered algorithm, whose ``Options`` model then
    takes the remaining keys (only that algorithm's)."""
    from ..registry import algorithm_class

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
