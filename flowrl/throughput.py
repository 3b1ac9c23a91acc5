"""Throughput and model FLOP utilisation of a run, phase by phase (rollout, update).

The FLOPs of a transformer call depend only on its input shapes, so each distinct shape is counted once, by
running that first call under ``torch.utils.flop_counter.FlopCounterMode`` (the call itself, no extra forward),
and later calls of the shape add the cached count. A forward that builds a graph is followed by its backward,
counted as what executes: the gradient of every activation (one forward's matmuls again), the attention's
extra backward matmuls (its backward does four where the forward does two), and the weight gradients only of
the layers whose weights train. Full fine-tuning is so about 3x the forward; LoRA, whose frozen base layers get
no weight gradient, about 2x plus the attention's share. Recomputation under gradient checkpointing is not
counted, as MFU conventions do not count it.

On a CPU, PyTorch's FLOP counter does not count the fused CPU attention kernel (it counts the CUDA ones), so
CPU figures are of the matmuls only.

MFU divides the achieved rate by the device's dense bf16 peak: ``train.peak_tflops`` where set, else the table
below by device name; unknown devices (and CPUs) report TFLOP/s without MFU.
"""

from __future__ import annotations

import math

import torch

# Dense bf16 tensor-core peak in TFLOP/s, by a substring of torch.cuda.get_device_name() (first match wins).
PEAK_TFLOPS = [("H200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H800", 989.0),
               ("H20", 148.0),
               ("B200", 2250.0), ("GB200", 2500.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0),
               ("L40", 181.0), ("A6000", 155.0), ("RTX 4090", 165.0), ("A10", 125.0), ("L4", 121.0)]


def device_peak_tflops(device: torch.device, configured: float | None) -> float | None:
    """The peak that MFU divides by (None: unknown, MFU not reported)."""
    if configured:
        return configured
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS if key in name), None)


def _shape_key(args, kwargs) -> tuple:
    def key(v):
        if isinstance(v, torch.Tensor):
            return ("t", tuple(v.shape), str(v.dtype))
        if isinstance(v, (list, tuple)):
            return tuple(key(x) for x in v)
        return ("v", repr(v)) if isinstance(v, (int, float, bool, str, type(None))) else ("o", type(v).__name__)

    return key(list(args)), tuple(sorted((k, key(v)) for k, v in kwargs.items()))


class FlopMeter:
    """Counts the model FLOPs of the transformer calls (forward hooks on each module), per phase.

    ``with meter.phase("rollout"): ...`` attributes the calls inside to that phase; ``meter.take()`` returns and
    resets ``{phase: flops}``. ``shapes_counted`` is how many distinct shapes ran under the FLOP counter."""

    def __init__(self, modules: list[torch.nn.Module | None]):
        modules = [m for m in modules if m is not None]  # absent ones (no frozen expert, no reference) skipped
        self.cache: dict[tuple, tuple[int, int]] = {}  # (module, shape) -> (forward FLOPs, backward FLOPs)
        self.flops: dict[str, float] = {}
        self.rows: dict[str, int] = {}  # samples through a transformer forward, per phase (CFG's halves each count)
        self.current = None
        self._counting = None  # (key, FlopCounterMode) while a new shape's first call runs
        self._handles = []
        self._trained = {id(m): any(p.requires_grad for p in m.parameters()) for m in modules}
        for m in modules:
            self._handles.append(m.register_forward_pre_hook(self._before, with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._after, with_kwargs=True))

    @property
    def shapes_counted(self) -> int:
        return len(self.cache)

    def phase(self, name: str):
        meter = self

        class _Phase:
            def __enter__(self):
                self.previous, meter.current = meter.current, name

            def __exit__(self, *exc):
                meter.current = self.previous

        return _Phase()

    def _before(self, module, args, kwargs):
        if self.current is None or self._counting is not None:
            return
        key = (id(module), torch.is_grad_enabled(), _shape_key(args, kwargs))
        if key not in self.cache:
            from torch.utils.flop_counter import FlopCounterMode

            counter = FlopCounterMode(display=False)
            weights = LayerFlops(module)
            counter.__enter__()
            self._counting = (key, counter, weights)

    def _after(self, module, args, kwargs, output):
        if self.current is None:
            return
        if self._counting is not None:
            key, counter, weights = self._counting
            if key[0] != id(module):
                return
            counter.__exit__(None, None, None)
            forward = counter.get_total_flops()
            self.cache[key] = (forward, backward_flops(forward, attention_flops(counter), weights.close()))
            self._counting = None
        else:
            key = (id(module), torch.is_grad_enabled(), _shape_key(args, kwargs))
        self.rows[self.current] = self.rows.get(self.current, 0) + _batch_rows(args, kwargs)
        forward, backward = self.cache.get(key, (0, 0))
        with_backward = torch.is_grad_enabled() and self._trained[id(module)]
        self.flops[self.current] = self.flops.get(self.current, 0) + forward + (backward if with_backward else 0)

    def take(self) -> dict[str, float]:
        out, self.flops = self.flops, {}
        return out

    def take_rows(self) -> dict[str, int]:
        """``{phase: transformer evaluations}`` since the last call (one sample through one forward each)."""
        out, self.rows = self.rows, {}
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()




ATTENTION_OPS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")


def backward_flops(forward: int, attention: int, layers: "LayerFlops") -> int:
    """The backward of one counted forward of ``forward`` FLOPs, as it executes: a linear or convolution layer
    computes its input's gradient only where that input carries one (not for the embedders that read the latents
    and the text, and not before the first trained layer under LoRA) and its weight's gradient only where the
    weight trains (a frozen LoRA base layer: none); the attention kernels do their two matmuls twice (four in
    the backward); what is left (norms, activations) once."""
    rest = max(forward - attention - layers.total, 0)
    return rest + 2 * attention + layers.input_grad + layers.weight_grad


def attention_flops(counter) -> int:
    return sum(f for op, f in counter.get_flop_counts().get("Global", {}).items()
               if any(a in str(op) for a in ATTENTION_OPS))


class LayerFlops:
    """While a counted forward runs: the matmul FLOPs of every linear and convolution layer, and how much of them
    its backward repeats for the input's gradient (the input carries one) and for the weight's (it trains)."""

    def __init__(self, module: torch.nn.Module):
        self.total = self.input_grad = self.weight_grad = 0
        self.handles = [m.register_forward_hook(self._count) for m in module.modules()
                        if isinstance(m, (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d))]

    def _count(self, m, inputs, output):
        if isinstance(m, torch.nn.Linear):
            flops = 2 * (inputs[0].numel() // m.in_features) * m.in_features * m.out_features
        else:  # each output element: in / groups x kernel multiply-adds
            flops = 2 * output.numel() * (m.in_channels // m.groups) * math.prod(m.kernel_size)
        self.total += flops
        if torch.is_grad_enabled():
            self.input_grad += flops if inputs[0].requires_grad else 0
            self.weight_grad += flops if m.weight.requires_grad else 0

    def close(self) -> "LayerFlops":
        for h in self.handles:
            h.remove()
        return self


def _batch_rows(args, kwargs) -> int:
    """The batch size of a transformer call: its latent input's first dimension."""
    first = kwargs.get("hidden_states", args[0] if args else None)
    if not isinstance(first, torch.Tensor):
        first = next((v for v in list(args) + list(kwargs.values()) if isinstance(v, torch.Tensor)), None)
    return int(first.shape[0]) if isinstance(first, torch.Tensor) and first.ndim else 0


def rates(flops: dict[str, float], seconds: dict[str, float], images: int, processes: int,
          peak_tflops: float | None) -> dict:
    """The metrics row's throughput fields: per phase, the FLOPs this process counted, its TFLOP/s, MFU (with a
    known peak) and images per second per process (the iteration's images over the phase's wall time and the
    process count)."""
    row = {}
    for phase in ("rollout", "update"):
        f, s = flops.get(phase, 0.0), seconds[phase]
        row[f"flops_{phase}"] = f
        row[f"tflops_{phase}"] = f / s / 1e12 if s > 0 else 0.0
        if peak_tflops:
            row[f"mfu_{phase}"] = row[f"tflops_{phase}"] / peak_tflops
        row[f"images_per_second_per_process_{phase}"] = images / s / processes if s > 0 else 0.0
    if peak_tflops:
        row["peak_tflops"] = peak_tflops
    return row


class WorkCounts:
    """The work a run has spent so far, in every metrics row and curve point: rollout evaluations, images scored,
    seconds and transformer evaluations of rollout and update; a resumed run continues the counts of its last
    row."""

    def __init__(self, last_row: dict | None = None):
        self.counts = {"nfe_rollout_cum": 0, "rollouts_cum": 0, "seconds_cum": 0.0, "evaluations_cum": 0}
        if last_row is not None:
            self.counts = {k: last_row.get(k, 0) for k in self.counts}

    def add(self, nfe: int, images: int, seconds: float, evaluations: int = 0) -> dict:
        """Count one iteration's work (``evaluations``: transformer evaluations of rollout and update together);
        returns the totals."""
        self.counts["nfe_rollout_cum"] += nfe
        self.counts["rollouts_cum"] += images
        self.counts["seconds_cum"] += seconds
        self.counts["evaluations_cum"] += evaluations
        return dict(self.counts)
