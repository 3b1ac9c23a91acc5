"""Which attention kernels the transformer runs, chosen explicitly (``train.attention_backend``).

PyTorch's scaled-dot-product attention picks among several kernels by its own priority; on Hopper GPUs that
includes cuDNN's fused attention, whose backward has failed on FLUX.1 and Qwen-Image shapes (``Expected
mha_graph.execute(handle, variant_pack, workspace_ptr.get()).is_good() to be true``) and is reported to return
wrong gradients for some strides. So the default allows flash attention, then memory-efficient attention, then
the math kernel, and never cuDNN; ``native_cudnn`` gives PyTorch its own choice back. ``xformers`` and ``flash``
are diffusers attention backends (their own kernels, set on the transformer by
:func:`flowrl.policy.configure_update_path`); for them the SDPA list does not matter.

The choice is a process-wide setting of PyTorch's, so it is applied for the duration of a phase with
:func:`attention_kernels` (a whole rollout, a whole update including its backward and any recomputation under
gradient checkpointing), not per call.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

from torch.nn.attention import SDPBackend, sdpa_kernel

# train.attention_backend -> what it is for (the config's help and the docs list these)
ATTENTION_BACKENDS = {
    "native": "PyTorch SDPA restricted to flash, then memory-efficient, then math attention; never cuDNN's (its "
              "backward fails or is wrong on some Hopper shapes)",
    "native_cudnn": "PyTorch SDPA with PyTorch's own kernel choice, cuDNN attention included (ask for it only where "
                    "its backward is known to work on your GPU and shapes)",
    "xformers": "xformers' memory-efficient attention through diffusers (the xformers extra)",
    "flash": "the flash-attn package's kernels through diffusers (the flash-attn extra)",
}
# the SDPA kernels each choice allows, in priority order (None: PyTorch's own list and order)
SDPA_KERNELS = {"native": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
                "native_cudnn": None, "xformers": None, "flash": None}
DIFFUSERS_BACKENDS = {"xformers": "xformers", "flash": "flash"}  # choices set on the transformer itself


@contextmanager
def attention_kernels(backend: str):
    """For the duration: PyTorch SDPA may use only the kernels ``backend`` allows, in its order."""
    kernels = SDPA_KERNELS[backend]
    with sdpa_kernel(kernels, set_priority=True) if kernels is not None else nullcontext():
        yield
