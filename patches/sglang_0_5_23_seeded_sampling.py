"""SGLang 0.5.23 on CPU: a request's `sampling_seed` decides its samples, as vLLM's seeded requests do.

Why a patch: SGLang reads `sampling_seed` only under its deterministic inference mode
(`enable_deterministic_inference`: `SamplingBatchInfo.from_schedule_batch` builds the batch's seed tensor
only then, srt/sampling/sampling_batch_info.py), which refuses the torch-native attention backend its CPU
path runs on ("only ['ascend', 'fa3', 'fa4', 'flashinfer', 'intel_xpu', 'triton'] attention backends are
supported for deterministic inference", srt/arg_groups/overrides.py). Without it every sample comes from
`torch.multinomial` on the scheduler process's one generator, seeded once at start (`random_seed`): the
same request draws other tokens after other work, and a resumed run, whose fresh engine starts that
generator again, draws other samples than the run it resumes drew (measured: the same 6 seeded requests
twice on one engine, 0 of 6 alike). And SGLang's seeded sampler (`multinomial_with_seed`) hashes with
`sgl_kernel`'s murmur_hash32_cpu, which the CPU install does not have (patches/sglang_0_5_23_cpu_imports.py).

The patch, in the scheduler processes of an SGLang engine on CPU (`SGLANG_USE_CPU_ENGINE=1`):

- `SamplingBatchInfo.adjusted_from_schedule_batch` (SGLang's hook for it, a no-op upstream) gives every
  batch the seed tensor deterministic mode would: a request's `sampling_seed`, or for a request without
  one a seed drawn once from the scheduler's `random` (seeded by `random_seed`), kept on the request.
  Every batch has one, so SGLang's merge and filter of batches keep it row for row.
- `sglang.srt.layers.sampler.multinomial_with_seed`, which SGLang's torch sampler then calls
  (`sampling_from_probs_torch`; the top-k / top-p path `top_k_top_p_min_p_sampling_from_probs_torch`
  too), draws with megatron_specrl.rollout.coupled's noise instead of the murmur hash: argmax over the
  token's log-probability plus Gumbel noise of (seed, position, token), float64. `position` is the
  token's position in the sequence (SGLang passes it: the decode position, or seq_len - 1 for the
  token a prefill samples), so a request's tokens depend on its seed, its prompt and the weights only:
  not on what the engine ran before, on the other requests of its batch, or on the engine's start.

Under fixed weights the samples stay exact (i.i.d. Gumbel noise per position and token, the Gumbel-max
trick). Log-probs are SGLang's as before. What the seed does not fix is the logits' last bits: SGLang
batches requests as they reach its scheduler, and a prompt prefilled beside other requests, or found in
the radix cache, gets fp32 logits that differ in the last bits (measured on the tiny model: the same
tokens, log-probs up to 5e-7 apart; a token differs only at a near tie of the noisy scores). The
rollout's requests carry seeds of (trainer.seed, step, prompt, sample) (rollout/speculative.py), eval's
of its prompt. The cost: ~1% of a CPU scheduler's decode time (py-spy, tiny model, 32 requests).

GPUs are left alone (`when`): SGLang's flashinfer sampler refuses seeds for top-k / top-p; there SGLang
reads the seeds in its own deterministic inference mode (enable_deterministic_inference, which
rollout.engine_kwargs.sglang passes on; not tested here).
Pinned to SGLang 0.5.23; applied by sglang_engine_patches.plugin() in processes our engine marked.
"""

from __future__ import annotations

import os
import random

import torch

from megatron_specrl.patches.pinned import PinnedPatch

VERSION = "0.5.23"
CPU_ENV = "SGLANG_USE_CPU_ENGINE"   # SGLang's switch for its CPU path (patches/sglang_0_5_23_cpu_imports.py)
_SEED_BITS = 63


DRAWN = "_specrl_sampling_seed"   # a request's drawn seed, on the request (its sampling params may be shared)


def request_seeds(reqs, draw=lambda: random.getrandbits(_SEED_BITS)) -> list[int]:
    """Each request's sampling seed; a request without one gets one from `draw` the first time, kept on
    the request (the same seed in every batch it is in)."""
    seeds = []
    for r in reqs:
        seed = r.sampling_params.sampling_seed
        if seed is None:
            seed = getattr(r, DRAWN, None)
            if seed is None:
                seed = int(draw())
                setattr(r, DRAWN, seed)
        seeds.append(int(seed))
    return seeds


def adjusted_from_schedule_batch(self, batch, vocab_size: int) -> None:
    """SamplingBatchInfo's hook after `from_schedule_batch`: the batch's seed tensor, unless SGLang's own
    deterministic mode built it."""
    if self.sampling_seed is None:
        self.sampling_seed = torch.tensor(request_seeds(batch.reqs), dtype=torch.int64, device=self.device)


def multinomial_with_seed(logprobs: torch.Tensor, seed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """SGLang's signature and shape ([n, 1] indices): argmax_v logprobs[r, v] + G(seed_r, position_r, v)."""
    from megatron_specrl.rollout.coupled import coupled_tokens
    return coupled_tokens(logprobs.to(torch.float64), seed, positions).unsqueeze(1)


def _on_cpu() -> bool:
    return os.environ.get(CPU_ENV) == "1"


def _batch_info():
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    return SamplingBatchInfo


def _sampler():
    from sglang.srt.layers import sampler
    return sampler


_BATCH = PinnedPatch(VERSION, _batch_info, ["adjusted_from_schedule_batch"],
                     lambda originals: {"adjusted_from_schedule_batch": adjusted_from_schedule_batch},
                     when=_on_cpu, package="sglang")
_SAMPLER = PinnedPatch(VERSION, _sampler, ["multinomial_with_seed"],
                       lambda originals: {"multinomial_with_seed": multinomial_with_seed},
                       when=_on_cpu, package="sglang")


def apply() -> bool:
    return _BATCH.apply() and _SAMPLER.apply()


def revert() -> None:
    _BATCH.revert()
    _SAMPLER.revert()


def is_applied() -> bool:
    return _BATCH.is_applied() and _SAMPLER.is_applied()
