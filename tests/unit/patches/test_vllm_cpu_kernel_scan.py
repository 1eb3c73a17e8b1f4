"""patches/vllm_0_32_0_cpu_kernel_scan.py: vLLM's CPU kernel overrides scan every module and crashed on
llvmlite's library proxy once numba was imported, so an engine started after the compiled draft
trees ran in the same process failed. The patched scan still rebinds captured kernels, leaves
the attributes it cannot read alone and puts them back; an in-process engine starts after numba compiled.
"""

import os
import sys
import types
import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # the engine in this process, as in Ray actors

pytest.importorskip("vllm")

from megatron_specrl.patches import vllm_0_32_0_cpu_kernel_scan as fix  # noqa: E402


class Proxy:
    """Answers every attribute, __dict__ included, as llvmlite.binding.ffi.lib does."""
    __slots__ = ()

    def __getattr__(self, name):
        return object()


@pytest.fixture
def fake_modules():
    kernel, wrapper = object(), object()
    holder = types.ModuleType("specrl_fake_holder")
    holder.captured = kernel                     # a `from mod import kernel` copy to rebind
    proxy = types.ModuleType("specrl_fake_proxy")
    proxy.lib = Proxy()
    sys.modules.update({holder.__name__: holder, proxy.__name__: proxy})
    yield kernel, wrapper, holder, proxy
    for name in (holder.__name__, proxy.__name__):
        sys.modules.pop(name, None)


def test_patched_scan_rebinds_and_survives_an_unreadable_module(fake_modules):
    from vllm.triton_utils import dispatcher
    kernel, wrapper, holder, proxy = fake_modules
    assert [(m, a) for m, a, *_ in fix.unreadable_values() if m.startswith("specrl_")] == [("specrl_fake_proxy", "lib")]
    if fix.is_applied():
        fix.revert()
    with pytest.raises(AttributeError):                # vLLM's own scan
        dispatcher._rebind_kernels([(kernel, wrapper)])
    holder.captured = kernel
    assert fix.apply()
    try:
        dispatcher._rebind_kernels([(kernel, wrapper)])
    finally:
        fix.revert()
    assert holder.captured is wrapper
    assert sys.modules["specrl_fake_proxy"] is proxy and isinstance(proxy.lib, Proxy)   # put back


def test_llvmlite_is_what_the_scan_cannot_read_once_numba_is_imported():
    pytest.importorskip("numba")
    import llvmlite.binding.ffi  # noqa: F401
    assert ("llvmlite.binding.ffi", "lib") in [(m, a) for m, a, *_ in fix.unreadable_values()]


