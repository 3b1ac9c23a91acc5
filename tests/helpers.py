"""User-style reward functions referenced as ``tests.helpers:function`` in tests."""

import torch


def wrong_shape(images, prompts, metadata):
    return torch.zeros(images.shape[0], 2)


def half_nan(images, prompts, metadata):
    out = torch.ones(images.shape[0])
    out[::2] = float("nan")
    return out


def brightness(images, prompts, metadata):
    return images.mean(dim=(1, 2, 3))


def per_prompt_constant(images, prompts, metadata):
    """Equal within every group, different between prompts: every group has zero variance."""
    return torch.tensor([float(len(p) % 3) for p in prompts])


def slow_brightness(images, prompts, metadata):
    """A scorer that takes a while (a remote or large model stands behind it)."""
    import time

    time.sleep(0.3)
    return images.mean(dim=(1, 2, 3))
