"""Seeded work that leaves the process's random generators as it found them.

Model builders (a tiny model's initial weights, a replica for the memory model) and a trainer's setup (LoRA's
initial weights) draw from torch's global generator, which a library must not reseed for its caller. Each runs
inside :func:`seeded`: the global generators are saved, seeded for the work, and restored after it, so the work is
reproducible and two trainers built one after another in one process each start where they would alone."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def seeded(seed: int, device: torch.device | str | None = None) -> Iterator[None]:
    """Run the block with torch's global generators seeded with ``seed``, restoring them afterwards.

    Args:
        seed: the seed of the CPU generator (and of the CUDA device's, where ``device`` is one).
        device: a CUDA device whose generator is forked as well; None or a CPU device forks the CPU's only.
    """
    device = torch.device(device) if device is not None else None
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device is not None and device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        yield


def keeps_generators(build):
    """Decorate a builder that seeds torch's global generator itself: the caller's generators (the CPU's, and the
    current CUDA device's where there is one) are restored when it returns."""

    @functools.wraps(build)
    def restoring(*args, **kwargs):
        cuda = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=cuda):
            return build(*args, **kwargs)

    return restoring
