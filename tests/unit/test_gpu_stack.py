"""The stack check every launched node and the container build run (megatron_specrl/gpu_stack.py).
"""

from megatron_specrl.gpu_stack import CONSTRAINTS, check_stack, read_pins

def test_pins_are_read_from_the_constraints_file():
    pins = read_pins(CONSTRAINTS)
    assert pins["vllm"] == "0.32.0" and pins["torch"] == "2.13.0" and pins["megatron-core"] == "0.16.1"
    assert "sglang" not in pins


def test_cpu_node_passes_and_a_gpu_node_without_cuda_or_te_fails_named():
    report, failures = check_stack("vllm", gpus=0)
    assert failures == [] and any(r.startswith("vllm==") for r in report)
    _, failures = check_stack("vllm", gpus=8)
    assert any(f.startswith("transformer-engine: import transformer_engine failed") for f in failures), failures
    assert "--gpus=8: CUDA sees 0 GPU(s) on this node" in failures
    # the CPU environment carries the pinned torch / vLLM / megatron-core / Ray / transformers versions
    assert not [f for f in failures if "pins" in f], failures
