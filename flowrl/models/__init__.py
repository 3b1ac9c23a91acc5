"""Model adapters, one per family, behind :class:`flowrl.models.base.ModelAdapter`: text encoding with a
cache, velocity with CFG for a batch of mixed sigmas, latent shape, decoding, LoRA targets, reference policy,
weight saving. Tiny offline models and exported tiny folders: :mod:`flowrl.models.tiny`."""

from .base import ModelAdapter
from .common import PromptEmbeds
from .flux import FluxAdapter
from .flux2 import Flux2Adapter
from .flux_kontext import FluxKontextAdapter
from .hunyuanvideo15 import HunyuanVideo15Adapter
from .ltx2 import LTX2Adapter
from .qwenimage import QwenImageAdapter
from .qwenimage_edit import QwenImageEditAdapter, QwenImageEditPlusAdapter
from .sd3 import SD3_LORA_TARGETS, SD3_PRESETS, SD3Adapter
from .wan import WanAdapter
from .zimage import ZImageAdapter

ADAPTERS = {"sd3": SD3Adapter, "flux": FluxAdapter, "flux2": Flux2Adapter, "qwenimage": QwenImageAdapter, "wan": WanAdapter,
            "zimage": ZImageAdapter, "flux-kontext": FluxKontextAdapter,
            "hunyuanvideo15": HunyuanVideo15Adapter, "ltx2": LTX2Adapter, "qwenimage-edit": QwenImageEditAdapter,
            "qwenimage-edit-plus": QwenImageEditPlusAdapter}


def load_adapter(model_cfg, device="cpu", sharded_reader: bool | None = None) -> ModelAdapter:
    """The adapter of ``model.family`` (a built-in, a registered family or ``module:Class``) for
    ``model.pretrained`` (a registered name, hub id or local folder).

    Args:
        model_cfg: the config's ``model`` section.
        device: where the transformer runs.
        sharded_reader: for a sharded run (``train.fsdp``), whether this process reads the trained transformer's
            weights (the main process does; the others build it without weights where the family allows, and
            receive their shards from it). None: not sharded.
    Returns:
        A :class:`~flowrl.models.base.ModelAdapter`.
    """
    from ..registry import adapter_class
    from .common import sharded_loading

    cls = adapter_class(model_cfg.family)
    if sharded_reader is None:
        return cls.from_config(model_cfg, device)
    # Wan 2.2 training its low-noise expert: the frozen high-noise one loads first and whole on every process
    meta = not sharded_reader and getattr(model_cfg, "train_expert", "high_noise") == "high_noise"
    with sharded_loading(meta_transformer=meta):
        return cls.from_config(model_cfg, device)


__all__ = ["ADAPTERS", "WanAdapter", "ZImageAdapter", "FluxKontextAdapter", "HunyuanVideo15Adapter", "LTX2Adapter", "QwenImageEditAdapter", "Flux2Adapter", "FluxAdapter", "QwenImageAdapter", "ModelAdapter", "PromptEmbeds", "SD3Adapter", "SD3_LORA_TARGETS", "SD3_PRESETS", "load_adapter"]
