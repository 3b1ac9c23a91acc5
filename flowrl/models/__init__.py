"""Model adapters: one per family; each owns text encoding, the batched transformer call with CFG,
latent <-> image decoding and LoRA targets."""

from .sd3 import SD3_LORA_TARGETS, SD3_PRESETS, SD3Adapter

__all__ = ["SD3Adapter", "SD3_LORA_TARGETS", "SD3_PRESETS"]
