"""The trainable policy: the adapter's transformer with LoRA (peft) or full weights, wrapped by accelerate,
its AdamW optimizer and optional EMA of the trained weights."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .errors import ConfigError


def add_lora(transformer, lora_cfg, default_targets: list[str]) -> None:
    from peft import LoraConfig

    targets = lora_cfg.targets or default_targets
    present = {name for name, _ in transformer.named_modules()}
    if not any(any(n.endswith(t) for n in present) for t in targets):
        raise ConfigError(f"train.lora.targets: none of {targets} name a module of this transformer")
    transformer.add_adapter(LoraConfig(r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, init_lora_weights="gaussian",
                                       target_modules=targets, lora_dropout=0.0))



def load_trained_weights(adapter, cfg, ckpt) -> None:
    """A run's checkpoint (LoRA or full fine-tuning, as it was trained) into the base model's ``adapter``.

    Args:
        adapter: the adapter :func:`flowrl.models.load_adapter` built for the run's ``model`` section.
        cfg: the run's config (its ``train.lora`` says the LoRA layout).
        ckpt: a checkpoint folder (:func:`flowrl.checkpoint.find_checkpoint` finds a run's).
    """
    from .checkpoint import checkpoint_is_lora, load_full_into, load_lora_into

    if checkpoint_is_lora(ckpt):
        add_lora(adapter.transformer, cfg.train.lora, adapter.lora_targets)
        load_lora_into(adapter.transformer, ckpt, cfg)
    else:
        load_full_into(adapter.transformer, ckpt, cfg)

def make_optimizer(params, t, device: torch.device):
    """AdamW: PyTorch's fused kernel on CUDA, or bitsandbytes' 8-bit AdamW (``train.optimizer=adamw_8bit``)."""
    kwargs = dict(lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay, eps=t.adam_eps)
    if t.optimizer == "adamw_8bit":
        import bitsandbytes as bnb  # checked at config load

        return bnb.optim.AdamW8bit(params, **kwargs)
    return torch.optim.AdamW(params, fused=device.type == "cuda", **kwargs)


def configure_update_path(transformer, t) -> None:
    """Gradient checkpointing, the attention backend and compiled blocks, as ``train`` asks."""
    if t.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    from .attention import DIFFUSERS_BACKENDS

    if t.attention_backend in DIFFUSERS_BACKENDS:  # the SDPA choices apply per phase (flowrl.attention)
        transformer.set_attention_backend(DIFFUSERS_BACKENDS[t.attention_backend])
    if t.compile_transformer:
        if getattr(transformer, "_repeated_blocks", None):
            transformer.compile_repeated_blocks(dynamic=True)
        else:  # families without the declaration (SD3): every block of the main stack
            for block in transformer.transformer_blocks:
                block.compile(dynamic=True)


class Policy:
    """Owns what the optimizer touches. ``accelerator.prepare`` wraps the transformer (DDP where launched so)."""

    def __init__(self, cfg, adapter, device: torch.device, procs=None):
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState

        # AcceleratorState is a process-wide singleton; a second Trainer in one process (tests, bench, notebooks)
        # with another precision must start from a fresh one. The distributed (partial) state is kept.
        AcceleratorState._reset_state(reset_partial_state=False)
        self.accelerator = Accelerator(mixed_precision=cfg.train.mixed_precision, cpu=device.type == "cpu",
                                       log_with=cfg.log.trackers or None)
        self.lora = cfg.train.lora.enabled
        transformer = adapter.transformer
        if self.lora:
            transformer.requires_grad_(False)
            add_lora(transformer, cfg.train.lora, adapter.lora_targets)
        else:
            transformer.requires_grad_(True)
        for p in transformer.parameters():  # trainable weights stay fp32 (mixed precision autocasts the forward)
            if p.requires_grad:
                p.data = p.data.float()
        t = cfg.train
        configure_update_path(transformer, t)
        self.sharded = t.fsdp.enabled
        self.frozen = None  # full fine-tuning's reference: a frozen copy of the starting weights (2x the memory)
        self.kl_reference = t.kl_reference if t.kl_beta > 0 or t.kl_untrained_beta > 0 else None
        if self.kl_reference == "initial" and not self.lora:
            import copy

            self.frozen = copy.deepcopy(transformer).requires_grad_(False).eval()
        if t.context_parallel.degree > 1:  # before sharding: diffusers' hooks go on the plain modules
            from .sharding import enable_context_parallel

            if not self.sharded:  # sharded, the weights reach the device with their shards
                transformer.to(device)
            others = [m for m in (self.frozen, *adapter.extra_transformers()) if m is not None]
            enable_context_parallel([transformer, *others], cfg, adapter, self.accelerator.num_processes)
        if self.sharded:
            self._shard(cfg, adapter, device, procs)
        self.params = [p for p in transformer.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(self.params, t, device)
        if self.sharded:
            self.optimizer = self.accelerator.prepare(self.optimizer)
        elif self.accelerator.num_processes > 1:
            # Several processes: no DDP wrapper. Processes run different numbers of forwards (their rollout batches
            # and work items differ in count and size) and flowrl.distributed sums the gradients once per step, so
            # the transformer stays a plain module and only its trainable weights are made equal at the start.
            from .distributed import check_launch, sync_parameters

            check_launch(self.accelerator)
            transformer.to(self.accelerator.device)
            sync_parameters(self.params)
            self.optimizer = self.accelerator.prepare(self.optimizer)
        else:
            adapter.transformer, self.optimizer = self.accelerator.prepare(transformer, self.optimizer)
        self.ema = None
        if t.ema.enabled:
            from diffusers.training_utils import EMAModel

            self.ema = EMAModel(self.params, decay=t.ema.decay)  # decay min((1+n)/(10+n), d) = Flow-GRPO's
        self.adapter = adapter
        self.old = None  # the old (sampling) policy's weights, where the algorithm keeps one
        self.anchor = None  # a reference other than the starting weights (a teacher, a moving anchor), or None
        self.anchors: dict[str, list[torch.Tensor]] = {}  # named references (one teacher per prompt domain)

    def _shard(self, cfg, adapter, device: torch.device, procs) -> None:
        """FSDP2 over every process (flowrl.sharding): the trained transformer and full fine-tuning's frozen
        reference copy, each on the same mesh. Every process starts from the main process's trainable
        weights (LoRA's random initialisation); the others may hold the transformer on the meta device."""
        from . import sharding
        from .distributed import Processes

        procs = procs or Processes(device)

        modules = [adapter.transformer] + ([self.frozen] if self.frozen is not None else [])
        self.mesh = sharding.device_mesh(device, self.accelerator.num_processes, cfg.train.fsdp)
        for m in modules:
            sharding.shard_from_main(m, self.mesh, cfg.train.fsdp, cfg.train.mixed_precision, device, procs,
                                     type(adapter).fsdp_units())

    def clip_gradients(self, max_norm: float) -> float:
        """Clip the trainable weights' gradient norm; returns the norm before clipping."""
        if self.sharded:
            from .sharding import clip_grad_norm

            return clip_grad_norm(self.params, max_norm)
        return float(self.accelerator.clip_grad_norm_(self.params, max_norm))

    def memory_mb(self) -> dict:
        """This process's bytes (MiB) of the transformer's weights, the trained weights' gradients and the optimizer
        state, as held (sharded: this process's shards)."""
        from .sharding import local

        def mb(tensors) -> float:
            return sum(local(t).numel() * local(t).element_size() for t in tensors) / 2 ** 20

        if self.sharded:
            from .sharding import reshard

            reshard(self.module)
        raw = getattr(self.optimizer, "optimizer", self.optimizer)
        state = [v for st in raw.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
        return {"memory/weights_mb": mb(self.module.parameters()),
                "memory/gradients_mb": mb(p.grad for p in self.params if p.grad is not None),
                "memory/optimizer_mb": mb(state),
                "memory/anchors_mb": mb([t for a in [self.anchor or [], *self.anchors.values()] for t in a])}

    @contextmanager
    def reference(self, name: str | None = None):
        """The KL reference policy in place of the trained one for the duration: the starting weights (LoRA
        disabled, or the frozen copy) or the EMA weights (``train.kl_reference``); the anchor where one is set;
        with ``name``, the named anchor (:meth:`load_anchor`'s ``name``)."""
        anchor = self.anchors[name] if name is not None else self.anchor
        if anchor is not None:
            self._swap(anchor)
            try:
                yield
            finally:
                self._swap(anchor)
        elif self.kl_reference == "ema":
            with self.ema_weights():
                yield
        elif self.frozen is None:
            with self.adapter.reference():
                yield
        else:
            trained, self.adapter.transformer = self.adapter.transformer, self.frozen
            try:
                yield
            finally:
                self.adapter.transformer = trained

    @property
    def module(self):
        """The transformer without accelerate's wrapper."""
        return self.accelerator.unwrap_model(self.adapter.transformer)

    # ---------------------------------------------------------------- the old (sampling) policy
    def enable_old_policy(self) -> None:
        """Keep an old copy of the trainable weights (DiffusionNFT's sampling policy)."""
        self.old = [p.detach().clone() for p in self.params]

    @contextmanager
    def old_weights(self, enabled: bool = True):
        """The old weights in place of the trained ones for the duration; nothing when there is no old copy (or
        ``enabled`` is false)."""
        if self.old is None or not enabled:
            yield
            return
        self._swap_old()  # exchanges the tensors behind the parameters: no copy of the weights (once per micro-batch)
        try:
            yield
        finally:
            self._swap_old()

    def _swap_old(self) -> None:
        self._swap(self.old)

    def _swap(self, other: list[torch.Tensor]) -> None:
        """Exchange the trainable weights with the tensors of ``other`` (the same shapes, in place)."""
        if self.sharded:  # FSDP keeps its own views of the shards: exchange values, not tensors
            with torch.no_grad():
                for o, p in zip(other, self.params):
                    kept = p.detach().clone()
                    p.copy_(o)
                    o.copy_(kept)
            return
        for k, p in enumerate(self.params):
            p.data, other[k] = other[k], p.data

    # ---------------------------------------------------------------- an anchor reference
    @torch.no_grad()
    def reset_anchor(self) -> None:
        """The KL reference becomes a copy of the current trainable weights (GARDO's reference reset); with LoRA
        the reference is the base model with this copy of the LoRA weights."""
        self.anchor = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def load_anchor(self, ckpt_dir, cfg, name: str | None = None) -> None:
        """The KL reference becomes a checkpoint's weights (on-policy distillation's teacher): a flowrl checkpoint
        folder (:func:`flowrl.checkpoint.find_checkpoint`'s answer) of the same model and LoRA layout, read into the
        transformer, copied, and the trained weights put back. With ``name`` it becomes a named reference
        (``reference(name)``) and the default one is left as it is."""
        from .checkpoint import checkpoint_is_lora, load_full_into, load_lora_into

        kept = [p.detach().clone() for p in self.params]
        (load_lora_into if checkpoint_is_lora(ckpt_dir) else load_full_into)(self.module, ckpt_dir, cfg)
        copy = [p.detach().clone() for p in self.params]
        if name is None:
            self.anchor = copy
        else:
            self.anchors[name] = copy
        for p, k in zip(self.params, kept):
            p.copy_(k)

    @torch.no_grad()
    def follow_old(self, decay: float) -> None:
        """old <- decay * old + (1 - decay) * trained."""
        for o, p in zip(self.old, self.params):
            o.mul_(decay).add_(p.detach(), alpha=1 - decay)

    def reset_ema(self) -> None:
        """The EMA restarts from the current weights (after loading other weights into the policy)."""
        if self.ema is not None:
            self.ema.load_state_dict({**self.ema.state_dict(), "shadow_params": [p.detach().clone() for p in self.params]})

    @contextmanager
    def ema_weights(self):
        """The EMA weights in place of the trained ones for the duration (sampling, evaluation)."""
        if self.ema is None:
            yield
            return
        self.ema.store(self.params)
        self.ema.copy_to(self.params)
        try:
            yield
        finally:
            self.ema.restore(self.params)
