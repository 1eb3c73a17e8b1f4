"""Version-pinned shims that let Megatron-core run on CPU (gloo).

`apply()` picks the module for the installed megatron-core version and is a
no-op when CUDA is available, so GPU runs use Megatron unmodified.
"""

from __future__ import annotations

import contextlib

import torch

TESTED_VERSIONS = ("0.16.1",)


class UnsupportedMegatronVersion(RuntimeError):
    """The CPU shims were written against one megatron-core release; refuse others."""


def megatron_version() -> str:
    import megatron.core
    return megatron.core.__version__


def _module():
    version = megatron_version()
    if version not in TESTED_VERSIONS:
        raise UnsupportedMegatronVersion(
            f"megatron-core {version} is untested with the CPU shims in patches/ (tested: "
            f"{', '.join(TESTED_VERSIONS)}); install megatron-core==0.16.1 or run on a CUDA GPU")
    from patches import megatron_core_0_16_1_cpu as mod
    return mod


def apply(force: bool = False) -> bool:
    """Install the CPU shims when CUDA is absent (or `force`). Returns True if installed."""
    if torch.cuda.is_available() and not force:
        return False
    return _module().apply()


def cuda_to_cpu():
    """Context manager: rewrite device="cuda" allocations in the pipeline schedules to CPU."""
    if torch.cuda.is_available():
        return contextlib.nullcontext()
    return _module().cuda_to_cpu()


def megatron_optimizer_on_cpu():
    """Context manager: Megatron's DDP and (distributed) optimizer run on CPU tensors (null on GPUs)."""
    if torch.cuda.is_available():
        return contextlib.nullcontext()
    return _module().megatron_optimizer_on_cpu()
