"""Hand-built logits rows and sampler columns for the vLLM engine's verification edges."""

from __future__ import annotations

from megatron_specrl.engines.vllm import llm_args
import numpy as np
import torch
from megatron_specrl.engines.protocol import SamplingSettings  # noqa: E402
from megatron_specrl.patches.vllm_0_32_0_batched_prompt_logprobs import (  # noqa: E402
    UNCOMPUTED, VerifyColumns, replacement_uniforms, verify_rows,
)


def _args(tmp_path, on_cpu, **kw):
    base = dict(on_cpu=on_cpu, seed=0, max_model_len=256, kv_cache_gb=0.5, gpu_memory_utilization=0.6,
                tensor_parallel_size=1, block_size=32 if on_cpu else 16, dtype="bfloat16",
                enable_prefix_caching=True, enforce_eager=None, cudagraph_capture_sizes=None, max_num_seqs=None,
                max_num_batched_tokens=None, logprobs_mode="processed_logprobs", draft="tree", draft_tokens=16)
    base.update(kw)
    return llm_args(str(tmp_path), **base)


VOCAB = 40


EOS = frozenset({1})


S = SamplingSettings(temperature=0.7, top_p=0.9)


def _logits(n: int, broken: dict[int, float], seed: int = 0) -> torch.Tensor:
    """[n, VOCAB] logits; row j of `broken` gets the value there (NaN, or +inf in one entry)."""
    x = torch.from_numpy(np.random.default_rng(seed).normal(0, 2, (n, VOCAB)).astype(np.float32))
    for j, v in broken.items():
        if np.isnan(v):
            x[j] = v
        else:
            x[j, 3] = v
    return x


def _columns(prompt_len: int, draft: list[int], logits: torch.Tensor, seed: int, coupled_seed: int | None):
    """The container a verification request hands `verify_columns`, built by the patch's own math."""
    n = len(draft)
    coupled = None
    if coupled_seed is not None:
        coupled = (torch.ones(n, dtype=torch.bool), torch.full((n,), coupled_seed, dtype=torch.int64),
                   torch.arange(n, dtype=torch.int64))
    positions = np.arange(prompt_len, prompt_len + n)
    ids, lps, _ = verify_rows(logits, torch.tensor(draft, dtype=torch.int64), torch.full((n,), S.temperature),
                              torch.full((n,), VOCAB, dtype=torch.int32), torch.full((n,), S.top_p),
                              torch.from_numpy(replacement_uniforms(seed, positions)), coupled)
    out = VerifyColumns()
    prompt_rows = torch.tensor([[7, 7, UNCOMPUTED, UNCOMPUTED]] * (prompt_len - 1), dtype=torch.int64)
    out.add(prompt_rows, torch.full((prompt_len - 1, 4), float("nan")))   # rows before the draft: not read
    out.add(ids, lps)
    return out


