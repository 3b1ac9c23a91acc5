"""Sharded training (``train.fsdp``): the transformer's weights, gradients and optimizer state split over the
processes with torch's FSDP2 (``fully_shard``), and the rule that keeps sharded processes in step.

Layout. Each repeated block of the family (diffusers' ``_repeated_blocks``, else ``_no_split_modules``: SD3's
``JointTransformerBlock``, FLUX's double and single blocks, Qwen-Image's, Wan's) is its own FSDP unit, and the
transformer is the root unit that holds the rest (embedders, norms, projections). The trained transformer is
sharded, and with it full fine-tuning's frozen reference copy. Text encoders, the VAE and Wan 2.2's frozen
expert (bf16, no gradients or optimizer state; which rows reach it differs between processes) are held whole. With ``train.fsdp.shard_size`` smaller than the world, the mesh is 2D
(replicas x shard): HSDP, each replica a full copy sharded over ``shard_size`` processes (one node), gradients
reduce-scattered within it and all-reduced across replicas.

Gradients are *summed* over processes (the divide factor is 1): each process's micro-batch loss is already
divided by the whole minibatch's rows, as in the data-parallel scheme of :mod:`flowrl.distributed`, so the
optimizer sees exactly one process's gradient.

Equal work. A sharded layer's forward is a collective (it gathers its weights from every process), so every
process must run the same sequence of transformer calls whatever its share of the work. Three places pad with
zero-weight work: the rollout (:class:`CallLedger`: a process that has finished its batches joins the others'
calls with calls on a one-row input whose output is dropped), the update (:func:`flowrl.optimise.optimise` adds micro-batches whose
loss is multiplied by 0) and held-out sampling (prompt shares padded to equal length, the padding's images
dropped). ``padding_calls_rollout`` and ``padding_micro_batches`` in the metrics count them.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .errors import ConfigError


def repeated_blocks(transformer: torch.nn.Module, units: tuple[str, ...] | None = None) -> list[torch.nn.Module]:
    """The transformer's FSDP units in module order: the modules whose class is named in ``units`` (the family's
    declaration, ``fsdp_units``), else in the transformer's own ``_repeated_blocks`` / ``_no_split_modules``."""
    names = set(units or getattr(transformer, "_repeated_blocks", None) or getattr(transformer, "_no_split_modules", None)
                or [])
    blocks = [m for m in transformer.modules() if type(m).__name__ in names]
    if not blocks:
        raise ConfigError(f"train.fsdp: {type(transformer).__name__} declares no repeated blocks to shard; set "
                          "train.fsdp.enabled=false")
    return blocks


def check_mesh(world: int, fsdp_cfg) -> tuple[int, int]:
    """(replicas, shard size) of the launch; one line when ``train.fsdp.shard_size`` does not divide it."""
    shard = fsdp_cfg.shard_size or world
    if shard > world or world % shard:
        raise ConfigError(f"train.fsdp.shard_size={fsdp_cfg.shard_size}: {world} processes cannot be split into "
                          f"replicas of {shard}; use a divisor of {world} (the processes per node for HSDP) or 0")
    return world // shard, shard


def launch_config(cfg):
    """The config an ``accelerate launch`` with an FSDP config (``distributed_type: FSDP``, ``fsdp_version: 2``; the
    shipped configs/accelerate/fsdp2_8gpu.yaml and hsdp_2x8.yaml) asks for: ``train.fsdp`` on with the launch's
    settings (reshard after forward, parameter offload, activation checkpointing, and HSDP's shard group from
    ``parallelism_config``). A new config object; the one given is returned unchanged outside such a launch and is
    never modified. flowrl applies the sharding itself (the repeated blocks, summed gradients)."""
    import os

    env = os.environ
    if env.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return cfg
    if env.get("FSDP_VERSION", "1") != "2":
        raise ConfigError("accelerate launch: flowrl shards with FSDP2; set fsdp_version: 2 in the accelerate config "
                          "(see configs/accelerate/fsdp2_8gpu.yaml)")

    def flag(name: str, default: bool) -> bool:
        return env.get(name, str(default)).lower() == "true"

    f = cfg.train.fsdp
    fsdp = {"enabled": True, "reshard_after_forward": flag("FSDP_RESHARD_AFTER_FORWARD", f.reshard_after_forward),
            "cpu_offload": flag("FSDP_OFFLOAD_PARAMS", f.cpu_offload)}
    if int(env.get("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "1")) > 1:
        fsdp["shard_size"] = int(env.get("PARALLELISM_CONFIG_DP_SHARD_SIZE", "0"))
    train = {"fsdp": f.model_copy(update=fsdp)}
    if flag("FSDP_ACTIVATION_CHECKPOINTING", False):
        train["gradient_checkpointing"] = True
    # flowrl builds its own (replicate, shard) mesh; accelerate's would be a second one it never uses
    env.pop("ACCELERATE_USE_PARALLELISM_CONFIG", None)
    launched = cfg.model_copy(update={"train": cfg.train.model_copy(update=train)})
    from .config import validate

    try:  # the config's checks again, on what the launch turned on (a refusal that reads train.fsdp, say)
        launched = validate(launched)
    except ConfigError as exc:
        raise ConfigError(f"under this accelerate launch (FSDP2 on): {exc}") from None
    return launched


def check_options(cfg, device: torch.device, world: int) -> None:
    """Everything about ``train.fsdp`` that can be refused before a model loads, one line each."""
    check_mesh(world, cfg.train.fsdp)
    if cfg.train.fsdp.cpu_offload and device.type != "cuda":
        raise ConfigError(f"train.fsdp.cpu_offload: moves the shards from a GPU to host memory; this run is on "
                          f"{device.type}; set train.fsdp.cpu_offload=false")
    if cfg.train.optimizer == "adamw_8bit":
        raise ConfigError("train.optimizer=adamw_8bit: bitsandbytes' 8-bit AdamW does not take sharded weights; "
                          "use train.optimizer=adamw with train.fsdp")


def device_mesh(device: torch.device, world: int, fsdp_cfg):
    """A 1D mesh (FSDP) or a 2D (replicate, shard) mesh (HSDP) over every process."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    replicas, shard = check_mesh(world, fsdp_cfg)
    kind = device.type
    if not dist.is_initialized():  # one process without a launcher: a group of one
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("nccl" if kind == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                world_size=1, rank=0)
    if replicas == 1:
        return init_device_mesh(kind, (shard,), mesh_dim_names=("shard",))
    return init_device_mesh(kind, (replicas, shard), mesh_dim_names=("replicate", "shard"))


def shard_module(module: torch.nn.Module, mesh, fsdp_cfg, mixed_precision: str,
                 units: tuple[str, ...] | None = None) -> None:
    """FSDP2 on ``module``: each unit (:func:`repeated_blocks`) sharded on its own, the module the root. bf16 (or
    fp16) compute where ``train.mixed_precision`` asks, with fp32 master weights and fp32 gradient reduction."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision)
    options = dict(mesh=mesh, reshard_after_forward=fsdp_cfg.reshard_after_forward,
                   mp_policy=MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32),
                   offload_policy=CPUOffloadPolicy() if fsdp_cfg.cpu_offload else OffloadPolicy())
    units = repeated_blocks(module, units)
    for block in units:
        fully_shard(block, **options)
    fully_shard(module, **options)
    for unit in (*units, module):
        unit.set_gradient_divide_factor(1.0)  # sum over processes: the losses are already divided by the rows
        unit.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)


def reshard(module: torch.nn.Module) -> None:
    """Free the gathered weights of every FSDP unit of ``module`` (``reshard_after_forward=false`` keeps them after
    a forward without gradients), so that its parameters are the shards the optimizer and checkpoints know."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def shard_from_main(module: torch.nn.Module, mesh, fsdp_cfg, mixed_precision: str, device: torch.device,
                    procs, units: tuple[str, ...] | None = None) -> None:
    """Shard ``module`` with the main process's weights: only the main process needs them (the others may have
    built the module on the meta device, without weights). Every process turns the module into meta tensors,
    shards it, allocates its own shards on ``device`` and receives them from the main process, one tensor at a
    time (``set_model_state_dict(..., broadcast_from_rank0=True)``). LoRA's random initialisation travels the same
    way, so every process starts from the main process's weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full = module.state_dict() if procs.is_main else {}  # kept alive past .to("meta") below
    persistent = set(module.state_dict(keep_vars=True)) if procs.is_main else None
    # buffers outside the state dict (Wan's rotary tables) are computed at construction: sent as they are
    extra = {n: b.detach().cpu() for n, b in module.named_buffers() if n not in persistent} if procs.is_main else None
    extra = procs.broadcast(extra)
    module.to("meta")
    shard_module(module, mesh, fsdp_cfg, mixed_precision, units)
    module.to_empty(device=device)
    set_model_state_dict(module, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    with torch.no_grad():
        for name, value in extra.items():
            module.get_buffer(name).copy_(value)
    del full


def is_sharded(param: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor)


def local(param: torch.Tensor) -> torch.Tensor:
    """This process's shard of a sharded parameter (the tensor itself otherwise)."""
    return param.to_local() if is_sharded(param) else param


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (gathered from every process where sharded)."""
    return tensor.full_tensor() if is_sharded(tensor) else tensor


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Clip the gradients' global L2 norm to ``max_norm``; returns the norm before clipping (every shard
    counted once, on every process)."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return float(full(norm))


# ------------------------------------------------------------------------------------------ equal work
class CallLedger:
    """Keeps the processes' calls of a sharded module in lockstep during a phase without gradients (the rollout).

    While armed, each call of ``module`` first tells the other processes that this one still has work (a
    one-number all-reduce, made before FSDP gathers the weights). A process that has finished its own work calls
    :meth:`finish`, which joins every call the others still make with a padding call (``pad()``: the module on a
    one-row input, output dropped) until no process has work left. So every process makes the same number of
    calls, in the same order, whatever its share (unequal batch counts, variable group sizes, trees)."""

    def __init__(self, module: torch.nn.Module, device: torch.device):
        self.device, self.armed, self.padding = device, False, False
        self._hook = module.register_forward_pre_hook(self._before_call, prepend=True)  # before FSDP's gather

    def _exchange(self, working: bool) -> bool:
        import torch.distributed as dist

        flag = torch.tensor([1.0 if working else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _before_call(self, module, args):
        if self.armed and not self.padding:
            self._exchange(True)

    def arm(self) -> None:
        self.armed = True

    def finish(self, pad) -> int:
        """Pad until every process is done; returns the padding calls this process made. Every process calls it
        once per armed phase."""
        made = 0
        try:
            while self._exchange(False):
                self.padding = True
                with torch.no_grad():
                    pad()
                self.padding = False
                made += 1
        finally:
            self.armed = self.padding = False
        return made

    def close(self) -> None:
        self._hook.remove()


def pad_call(adapter, latent_shape: tuple[int, ...], cond):
    """A zero-weight call of the trained transformer: the velocity of one zero latent for ``cond``'s first row, at a
    sigma the trained transformer draws (``adapter.pad_sigma()``: a family with several experts routes sigmas)."""
    row = torch.zeros(1, dtype=torch.long, device=cond.embeds.device)
    x = torch.zeros(1, *latent_shape, device=adapter.device)
    sigma = adapter.pad_sigma()
    return lambda: adapter.velocity(x, torch.full((1,), sigma, device=adapter.device), cond.index(row))


# ------------------------------------------------------------------------------------------ context parallelism
def families_with_context_parallel() -> list[str]:
    """The registered model families whose transformer has a context-parallel plan (each adapter says)."""
    from .registry import MODEL_FAMILIES

    return [name for name in MODEL_FAMILIES.names() if MODEL_FAMILIES.resolve(name).context_parallel_plan()]


def check_context(cfg, processes: int) -> None:
    """``train.context_parallel``, before a model loads: a family with a plan (its adapter's
    ``context_parallel_plan``), a degree that divides the launch."""
    from .registry import adapter_class

    cp = cfg.train.context_parallel
    if cp.degree == 1:
        return
    family = adapter_class(cfg.model.family)
    if not family.context_parallel_plan():
        why = f" ({family.context_parallel_refusal})" if family.context_parallel_refusal else ""
        raise ConfigError(f"train.context_parallel: the {cfg.model.family} family's transformer has no context-parallel "
                          f"plan{why}; use one of {', '.join(families_with_context_parallel())}, or set "
                          f"train.context_parallel.ulysses=1 and ring=1")
    if processes % cp.degree:
        raise ConfigError(f"train.context_parallel: ulysses x ring = {cp.degree} does not divide the {processes} "
                          f"processes of this launch; launch a multiple of {cp.degree}")


@contextmanager
def _accelerator_for_cpu(device: torch.device):
    """diffusers resolves a process's device as ``accelerator:(rank % device_count)``; a CPU run has no device count,
    so for the duration the CPU is the accelerator with one device."""
    if device.type != "cpu":
        yield
        return
    count, current = torch.accelerator.device_count, torch._C._get_accelerator
    torch.accelerator.device_count = lambda: 1
    torch._C._get_accelerator = lambda: torch.device("cpu")
    try:
        yield
    finally:
        torch.accelerator.device_count, torch._C._get_accelerator = count, current


def enable_context_parallel(modules: list[torch.nn.Module], cfg, adapter, processes: int) -> None:
    """diffusers' context parallelism on each transformer: groups of ulysses x ring consecutive processes split each
    sample's sequence (the plan's inputs split before the blocks, the output gathered after ``proj_out``), so every
    process of a group gets the whole velocity. One line when the heads or the sequence do not divide."""
    from diffusers import ContextParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    cp = cfg.train.context_parallel
    heads = adapter.transformer.config.num_attention_heads
    if heads % cp.ulysses:
        raise ConfigError(f"train.context_parallel.ulysses={cp.ulysses}: the transformer's {heads} attention heads do "
                          f"not split evenly; use a divisor of {heads}")
    tokens = adapter.image_seq_len(cfg.model.resolution)
    text = adapter.encode_prompts(["a"]).embeds.shape[1] if type(adapter).context_parallel_splits_text else 0
    for what, n in (("image tokens", tokens), ("text tokens", text)):
        if n % cp.degree:
            raise ConfigError(f"train.context_parallel: {n} {what} per sample do not split into {cp.degree} equal "
                              f"parts; change model.resolution (or model.max_sequence_length) or the degree")
    device = adapter.device
    mesh = init_device_mesh(device.type, (processes // cp.degree, cp.ring, cp.ulysses),
                            mesh_dim_names=("data", "ring", "ulysses"))
    for module in modules:
        with _accelerator_for_cpu(device):
            module.enable_parallelism(config=ContextParallelConfig(ring_degree=cp.ring, ulysses_degree=cp.ulysses,
                                                                   mesh=mesh["ring", "ulysses"]))
