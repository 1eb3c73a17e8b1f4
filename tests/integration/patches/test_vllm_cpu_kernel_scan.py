"""patches/vllm_0_32_0_cpu_kernel_scan.py: vLLM's CPU kernel overrides scan every module and crashed on

The tests of this subject that start processes or engines; the rest are in tests/unit/patches/test_vllm_cpu_kernel_scan.py.
"""

import os
import sys
import pytest

# the engine's workers in this process, as in a Ray engine actor (ray_engine.ACTOR_ENV): the tree calls'
# collective_rpc hands the workers a function, which vLLM will not serialize to a worker process. The
# test passed only where another collected module had set this.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@pytest.mark.slow
def test_an_engine_starts_after_the_compiled_trees_ran_in_the_process(tiny_llama, tmp_path):
    from megatron_specrl.engines.protocol import GenerateRequest, SamplingSettings
    from megatron_specrl.engines.vllm import VLLMEngine
    from megatron_specrl.rollout.tree_drafting.compiled_trees import CompiledDraftTrees
    trees = CompiledDraftTrees()
    trees.start("r", "k", [1, 2, 3])
    trees.extend_and_propose(["r"], [4], 4)             # numba compiled (or loaded) in this process
    assert "llvmlite.binding.ffi" in sys.modules
    eng = VLLMEngine(str(tiny_llama), name="vllm-after-numba", seed=0, max_model_len=128, kv_cache_gb=0.1,
                     log_dir=tmp_path, draft="tree", drafter={"tokens": 4, "min_prob": 0.0})
    try:
        # drafted random sampling: the rejection sampler's kernels, which the scan must still rebind
        for _ in range(2):
            out = eng.generate([GenerateRequest([1, 2, 3], 12, seed=i, draft_key="p", response_start=3) for i in range(8)],
                               SamplingSettings(), eng.weight_version)
            assert len(out) == 8 and all(len(o.token_ids) == 12 for o in out)
        assert eng.draft_stats()["draft_tokens"] > 0
    finally:
        eng.shutdown()


