"""patches/vllm_0_32_0_cpu_kernel_scan.py: vLLM's CPU kernel overrides scan every module and crashed on
llvmlite's library proxy once numba was imported, so an engine started after the compiled draft
trees ran in the same process failed. The patched scan still rebinds captured kernels, leaves
the attributes it cannot read alone and puts them back; an in-process engine starts after numba compiled."""

import os
import sys
import types

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # the engine in this process, as in Ray actors

pytest.importorskip("vllm")

from patches import vllm_0_32_0_cpu_kernel_scan as fix  # noqa: E402


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


@pytest.mark.slow
def test_an_engine_starts_after_the_compiled_trees_ran_in_the_process(tiny_llama, tmp_path):
    from megatron_specrl.engines.protocol import GenerateRequest, SamplingSettings
    from megatron_specrl.engines.vllm_engine import VLLMEngine
    from megatron_specrl.rollout.draft_tree_compiled import CompiledDraftTrees
    trees = CompiledDraftTrees()
    trees.start("r", "k", [1, 2, 3])
    trees.extend_and_propose(["r"], [4], 4)             # numba compiled (or loaded) in this process
    assert "llvmlite.binding.ffi" in sys.modules
    eng = VLLMEngine(str(tiny_llama), name="vllm-after-numba", seed=0, max_model_len=128, kv_cache_gb=0.1,
                     log_dir=tmp_path, draft="tree", draft_tokens=4, draft_settings={"min_prob": 0.0})
    try:
        # drafted random sampling: the rejection sampler's kernels, which the scan must still rebind
        for _ in range(2):
            out = eng.generate([GenerateRequest([1, 2, 3], 12, seed=i, draft_key="p", response_start=3) for i in range(8)],
                               SamplingSettings(), eng.weight_version)
            assert len(out) == 8 and all(len(o.token_ids) == 12 for o in out)
        assert eng.draft_stats()["draft_tokens"] > 0
    finally:
        eng.shutdown()
