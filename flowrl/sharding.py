"""Sharded training (``train.fsdp``): the transformer's weights, gradients and optimizer state split over the
processes with torch's FSDP2 (``fully_shard``), and the rule that keeps sharded processes in step.

Layout. Each repeated block of the family (diffusers' ``_repeated_blocks``, else ``_no_split_modules``: SD3's
``JointTransformerBlock``, FLUX's double and single blocks, Qwen-Image's, Wan's; both Wan 2.2 experts) is its own
FSDP unit, and the transformer is the root unit that holds the rest (embedders, norms, projections). Text encoders
and the VAE are never sharded. With ``train.fsdp.shard_size`` smaller than the world, the mesh is 2D
(replicas x shard): HSDP, each replica a full copy sharded over ``shard_size`` processes (one node), gradients
reduce-scattered within it and all-reduced across replicas.

Gradients are *summed* over processes (the divide factor is 1): each process's micro-batch loss is already
divided by the whole minibatch's rows, as in the data-parallel scheme of :mod:`flowrl.distributed`, so the
optimizer sees exactly one process's gradient.

Equal work. A sharded layer's forward is a collective (it gathers its weights from every process), so every
process must run the same sequence of transformer calls whatever its share of the work. Three places pad with
zero-weight work: the rollout (:class:`CallLedger`: after a process's batches, it makes the calls it is short of
on a one-row input whose output is dropped), the update (:func:`flowrl.optimise.optimise` adds micro-batches whose
loss is multiplied by 0) and held-out sampling (prompt shares padded to equal length, the padding's images
dropped). ``padding_calls`` in the metrics counts them.
"""

from __future__ import annotations

import torch

from .errors import ConfigError


def repeated_blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer's repeated blocks (one FSDP unit each), in module order."""
    names = set(getattr(transformer, "_repeated_blocks", None) or getattr(transformer, "_no_split_modules", None) or [])
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


def shard_module(module: torch.nn.Module, mesh, fsdp_cfg, mixed_precision: str) -> None:
    """FSDP2 on ``module``: each repeated block a unit, the module the root. bf16 (or fp16) compute where
    ``train.mixed_precision`` asks, with fp32 master weights and fp32 gradient reduction."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision)
    options = dict(mesh=mesh, reshard_after_forward=fsdp_cfg.reshard_after_forward,
                   mp_policy=MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32),
                   offload_policy=CPUOffloadPolicy() if fsdp_cfg.cpu_offload else OffloadPolicy())
    units = repeated_blocks(module)
    for block in units:
        fully_shard(block, **options)
    fully_shard(module, **options)
    for unit in (*units, module):
        unit.set_gradient_divide_factor(1.0)  # sum over processes: the losses are already divided by the rows
        unit.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)


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
    """Counts forward calls of the sharded modules (forward pre-hooks) so that processes can even them out.

    ``pad_calls`` ``[(module, call)]``: ``call()`` runs ``module`` exactly once on a small input and drops the
    output (the adapter's velocity on one row at a sigma that routes to that module)."""

    def __init__(self, modules: list[torch.nn.Module]):
        self.modules = modules
        self.counts = [0] * len(modules)
        self._hooks = [m.register_forward_pre_hook(self._counter(i)) for i, m in enumerate(modules)]

    def _counter(self, i: int):
        def hook(module, args):
            self.counts[i] += 1
        return hook

    def reset(self) -> None:
        self.counts = [0] * len(self.modules)

    def even_out(self, procs, calls) -> int:
        """Make this process's call counts equal to the largest of any process, with ``calls[i]()`` for module i;
        returns the padding calls made here. Every process must call it at the same point."""
        everyone = procs.gather([list(self.counts)])
        target = [max(c[i] for c in everyone) for i in range(len(self.modules))]
        made = 0
        with torch.no_grad():
            for i, call in enumerate(calls):
                for _ in range(target[i] - self.counts[i]):
                    call()
                    made += 1
        return made

    def close(self) -> None:
        for h in self._hooks:
            h.remove()


def pad_calls(adapter, latent_shape: tuple[int, ...], cond) -> list:
    """One zero-weight call per sharded module of ``adapter``: the velocity of one zero latent for ``cond``'s first
    row, at a sigma that the module draws (Wan 2.2 routes sigmas to its two experts)."""
    row = torch.zeros(1, dtype=torch.long, device=cond.embeds.device)
    x = torch.zeros(1, *latent_shape, device=adapter.device)

    def at(sigma: float):
        return lambda: adapter.velocity(x, torch.full((1,), sigma, device=adapter.device), cond.index(row))

    boundary = getattr(adapter, "boundary", None)
    if boundary is None:
        return [at(0.5)]
    high, low = min(1.0, boundary / 1000 + 0.05), boundary / 2000  # a sigma each side of the expert boundary
    trained_high = adapter.train_expert == "high_noise"
    return [at(high if trained_high else low), at(low if trained_high else high)]


def sharded_modules(adapter) -> list[torch.nn.Module]:
    """The transformers that are sharded: the trained one, and Wan 2.2's other expert."""
    other = getattr(adapter, "frozen_expert", None)
    return [adapter.transformer] + ([other] if other is not None else [])
