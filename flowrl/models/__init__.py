"""Model adapters, one per family, behind :class:`flowrl.models.base.ModelAdapter`: text encoding with a
cache, velocity with CFG for a batch of mixed sigmas, latent shape, decoding, LoRA targets, reference policy,
weight saving. Tiny offline models and exported tiny folders: :mod:`flowrl.models.tiny`."""

from .base import ModelAdapter
from .common import PromptEmbeds
from .flux import FluxAdapter
from .flux2 import Flux2Adapter
from .qwenimage import QwenImageAdapter
from .sd3 import SD3_LORA_TARGETS, SD3_PRESETS, SD3Adapter
from .wan import WanAdapter

ADAPTERS = {"sd3": SD3Adapter, "flux": FluxAdapter, "flux2": Flux2Adapter, "qwenimage": QwenImageAdapter, "wan": WanAdapter}


def load_adapter(model_cfg, device="cpu") -> ModelAdapter:
    """The adapter of ``model.family`` (a built-in, a registered family or ``module:Class``) for
    ``model.pretrained`` (a registered name, hub id or local folder).

    Args:
        model_cfg: the config's ``model`` section.
        device: where the transformer runs.
    Returns:
        A :class:`~flowrl.models.base.ModelAdapter`.
    """
    from ..registry import adapter_class

    return adapter_class(model_cfg.family).from_config(model_cfg, device)


__all__ = ["ADAPTERS", "WanAdapter", "Flux2Adapter", "FluxAdapter", "QwenImageAdapter", "ModelAdapter", "PromptEmbeds", "SD3Adapter", "SD3_LORA_TARGETS", "SD3_PRESETS", "load_adapter"]
