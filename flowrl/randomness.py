"""Seeded side work that leaves the process's random generators as it found them.

The memory probe of ``train.micro_batch=auto`` builds replicas with a seed of its own, on the main process only;
run under :func:`keeps_generators`, it leaves every process's global generator where the run's seeding put it, so
the processes of a sharded run start training in step."""

from __future__ import annotations

import functools

import torch


def keeps_generators(build):
    """Decorate a builder that seeds torch's global generator itself: the caller's generators (the CPU's, and the
    current CUDA device's where there is one) are restored when it returns."""

    @functools.wraps(build)
    def restoring(*args, **kwargs):
        cuda = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=cuda):
            return build(*args, **kwargs)

    return restoring
