"""The embedded tiny image model (``model.pretrained: tiny-shapes``): the SD3-architecture model pretrained on
the shapes domain by ``flowrl pretrain-tiny`` and shipped in the package's assets."""

from __future__ import annotations

from pathlib import Path

from ..errors import FlowRLError
from ..models.tiny import load_exported_tiny_sd3
from ..resources import assets_dir


def load_tiny_shapes_pipeline(path: str | Path | None = None):
    """The shipped model (or a folder written by ``flowrl pretrain-tiny --export-dir``) as a
    StableDiffusion3Pipeline (fp32)."""
    path = Path(path) if path else assets_dir() / "tiny_shapes"
    if not (path / "transformer" / "config.json").is_file():
        raise FlowRLError(f"the pretrained tiny model is missing at {path}; run `flowrl pretrain-tiny` to rebuild it")
    return load_exported_tiny_sd3(path)


def load_tiny_shapes_edit_pipeline(path: str | Path | None = None):
    """The shipped tiny image-editing model (``model.pretrained: tiny-shapes-edit``; or a folder written by
    ``flowrl pretrain-tiny-edit --export-dir``) as a pixel-space FluxKontextPipeline (fp32)."""
    from ..models.tiny import load_exported_tiny_flux_kontext

    path = Path(path) if path else assets_dir() / "tiny_shapes_edit"
    if not (path / "transformer" / "config.json").is_file():
        raise FlowRLError(f"the pretrained tiny editing model is missing at {path}; run `flowrl pretrain-tiny-edit` "
                          "to rebuild it")
    return load_exported_tiny_flux_kontext(path)
