"""Low-precision linear layers for a pass whose outputs are never trained on (the candidate pool's cheap rollout).

Inside :func:`low_precision_linears` every ``torch.nn.Linear`` of the given modules runs from a copy of its weights
quantized once on entry (so a copy always reflects the current, still training, weights), and each call quantizes
its activations:

- ``int8``: dynamic int8 on the CPU (PyTorch's fbgemm kernels): weights per output channel in +-127, activations
  per tensor, affine in 256 levels. One linear layer of the tiny model's rollout shape (4,608 x 192 -> 768) took
  5.2 ms against 16.0 ms in float32 on one core of a two-core machine.
- ``fp8``: float8 e4m3 weights and activations, scaled per output channel and per row, through
  ``torch._scaled_mm``: the FP8 tensor cores of CUDA GPUs of compute capability 8.9 and newer (L40, H100, H200,
  B200). On a CPU it runs emulated, slower than float32 (25.4 ms for the layer above), which is good for tests only.

Attention, normalisation and everything that is not a linear layer keep the model's dtype, and so do fp8 layers
whose sizes are not multiples of 16. On exit the modules are as they were (their own weights were never touched).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch

LOW_PRECISIONS = ("int8", "fp8")
FP8_MAX = 448.0  # the largest float8 e4m3 value
INT8_MAX = 127.0


def unavailable(precision: str, device: torch.device) -> str | None:
    """Why ``precision`` cannot run on ``device`` (None where it can), found by one tiny call of the kernel."""
    if precision not in LOW_PRECISIONS:
        return None
    if precision == "int8" and device.type != "cpu":
        return "int8 runs on the CPU (fbgemm); on a GPU use fp8 (compute capability 8.9+) or bf16"
    if precision == "fp8" and device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            return (f"fp8 needs a GPU with FP8 tensor cores (compute capability 8.9+); this one is {major}.{minor}: "
                    "use bf16")
    try:
        probe = torch.nn.Linear(32, 32).to(device)
        with low_precision_linears([probe], precision):
            probe(torch.randn(16, 32, device=device))
    except (RuntimeError, NotImplementedError) as err:
        return f"{precision} matrix multiply failed on {device.type}: {str(err).splitlines()[0]}"
    return None


class _Int8Linear:
    """A linear layer's int8 call (CPU): weights quantized per output channel once, activations per call."""

    def __init__(self, layer: torch.nn.Linear):
        w = layer.weight.detach().float()  # (out, in)
        scales = (w.abs().amax(dim=1) / INT8_MAX).clamp_min(1e-12).double()  # (out,)
        with warnings.catch_warnings():  # PyTorch announces a replacement for quantized tensors, not yet released
            warnings.simplefilter("ignore")
            q = torch.quantize_per_channel(w, scales, torch.zeros_like(scales, dtype=torch.long), 0, torch.qint8)
        bias = None if layer.bias is None else layer.bias.detach().float()
        self.packed = torch.ops.quantized.linear_prepack(q, bias)
        self.out_features = layer.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., in) -> (..., out)
        y = torch.ops.quantized.linear_dynamic(x.reshape(-1, x.shape[-1]).float().contiguous(), self.packed)
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)


class _Fp8Linear:
    """A linear layer's fp8 call: e4m3 weights with per-output-channel scales, activations scaled per row."""

    def __init__(self, layer: torch.nn.Linear):
        w = layer.weight.detach().float()  # (out, in)
        scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(1e-12)  # (out, 1)
        self.weight_t = (w / scale).to(torch.float8_e4m3fn).t()  # (in, out), column-major as _scaled_mm wants
        self.scale_t = scale.t().contiguous()  # (1, out)
        self.bias = None if layer.bias is None else layer.bias.detach()
        self.out_features = layer.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., in) -> (..., out)
        rows = x.reshape(-1, x.shape[-1]).float()  # (M, in)
        scale = (rows.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(1e-12)  # (M, 1)
        y = torch._scaled_mm((rows / scale).to(torch.float8_e4m3fn), self.weight_t, scale_a=scale,
                             scale_b=self.scale_t, out_dtype=torch.bfloat16)  # (M, out)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)


def fits(precision: str, layer: torch.nn.Linear) -> bool:
    """FP8 matrix multiplies take sizes in multiples of 16; a layer of other sizes (a tiny model's, a 3-channel
    output) keeps its own precision."""
    return precision != "fp8" or (layer.in_features % 16 == 0 and layer.out_features % 16 == 0)


@contextmanager
def low_precision_linears(modules, precision: str):
    """For the duration, every ``torch.nn.Linear`` in ``modules`` calls its ``precision`` copy (int8 or fp8)."""
    make = {"int8": _Int8Linear, "fp8": _Fp8Linear}[precision]
    swapped, seen = [], set()  # (layer, the instance's own forward if it had one); layers shared by two modules once
    try:
        for module in modules:
            for layer in module.modules():
                if isinstance(layer, torch.nn.Linear) and id(layer) not in seen and fits(precision, layer):
                    seen.add(id(layer))
                    swapped.append((layer, layer.__dict__.get("forward")))
                    layer.forward = make(layer)
        yield
    finally:
        for layer, own in swapped:
            if own is None:
                del layer.forward
            else:
                layer.forward = own
