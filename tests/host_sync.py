"""Counting the operations that make the host wait for an accelerator, on any machine.

On CUDA the host queues kernels and runs ahead; an operation whose result the host must read (a tensor's value
as a Python number, a data-dependent output size, a copy into host memory, a copy from pageable host memory)
makes it wait until the device has finished everything queued, and the next kernels start late. A rollout that
does this once per denoising round loses the overlap on every round. :class:`HostSyncCounter` counts these
operations on the tensors of one device: on a CPU it counts them on CPU tensors, so a test without a GPU sees
the same operations (copies between host and device cannot happen there and are counted only on a GPU).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# operations whose output the host must read before it can go on (a value, or an output size it cannot know)
_READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.is_nonzero.default,
          aten.masked_select.default, aten._unique2.default, aten.unique_consecutive.default,
          aten.unique_dim.default}
_COPIES = {aten._to_copy.default, aten.copy_.default}
_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


class _Dispatch(TorchDispatchMode):
    def __init__(self, owner: "HostSyncCounter"):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.owner._see(func, args, kwargs, out)
        return out


class _Functions(TorchFunctionMode):
    def __init__(self, owner: "HostSyncCounter"):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # tolist reads a host tensor without a dispatched operation; a device tensor's is a counted copy
        if func is torch.Tensor.tolist and args and args[0].device == self.owner.device == torch.device("cpu"):
            self.owner.counts["tolist"] += 1
        return func(*args, **(kwargs or {}))


class HostSyncCounter:
    """``with HostSyncCounter(device) as c: ...`` counts, in ``c.counts`` (name -> calls) and ``c.total``, the
    operations on ``device``'s tensors that would make the host wait for a CUDA device: reading a value
    (``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``), data-dependent sizes (``nonzero``, boolean-mask
    indexing, ``masked_select``, ``unique``, ``repeat_interleave`` with tensor repeats), copies from the device to
    the host and blocking copies from the host to the device."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.counts: Counter = Counter()
        self._modes = (_Functions(self), _Dispatch(self))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __enter__(self) -> "HostSyncCounter":
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def _on_device(self, values) -> bool:
        return any(t.device == self.device for t in _tensors(values))

    def _see(self, func, args, kwargs, out) -> None:
        name = func.name() if hasattr(func, "name") else str(func)
        if func in _READS and self._on_device(args):
            self.counts[name] += 1
        elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None and self._on_device(args):
            self.counts[name] += 1
        elif func in _INDEXING and self._on_device(args) and any(
                t is not None and t.dtype == torch.bool for t in _tensors(args[1] if len(args) > 1 else ())):
            self.counts[name + " (boolean mask)"] += 1
        elif func in _COPIES:
            src = args[1] if func is aten.copy_.default else args[0]
            dst = args[0] if func is aten.copy_.default else out
            blocking = not (kwargs.get("non_blocking") or (len(args) > 2 and args[2] is True))
            if src.device == dst.device:
                return
            to_host = src.device == self.device and dst.device.type == "cpu"
            from_pageable = dst.device == self.device and blocking
            if to_host or from_pageable:
                self.counts[name + (" device-to-host" if to_host else " host-to-device, blocking")] += 1
