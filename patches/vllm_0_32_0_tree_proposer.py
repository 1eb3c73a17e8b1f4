"""vLLM 0.32.0: let a `custom_class` speculative proposer see the runner's input batch.

Why: our draft proposer (megatron_specrl.engines.tree_proposer.TreeProposer) drafts from a
per-prompt tree of earlier responses, so it must know which prompt each running request
belongs to. vLLM 0.32's `custom_class` hook calls `propose(sampled_token_ids,
num_tokens_no_spec, token_ids_cpu, slot_mappings)`: rows of token ids, no request ids.
The suffix-decoding proposer gets the input batch, but only through a branch hard-wired to
`SuffixDecodingProposer` and arctic-inference (no CPU wheel for the versions vLLM 0.32 needs).

The patch wraps `GPUModelRunner.propose_draft_token_ids` (the CPU runner inherits it): when the
drafter declares `specrl_batch_proposer = True`, it is called as
`drafter.propose_batch(input_batch, requests, sampled_token_ids)` and its lists of draft token
ids (any length up to num_speculative_tokens, [] for none) go back to vLLM as the `ngram` and
`suffix` proposers' do. Everything else (scheduling the drafts, the rejection sampler, log-probs
of accepted tokens) is vLLM's own code, unchanged: a point-mass draft is accepted with the
target probability p(x) under the request's processed distribution (temperature, top-k, top-p)
and a rejection resamples from p with x removed, so the output distribution is the target's.

Pinned to vLLM 0.32.0; on other versions `apply()` leaves vLLM alone and returns False. Only
engines this project starts call `apply()` (VLLMEngine, before building its LLM).
"""

from __future__ import annotations

from patches.pinned import PinnedPatch

VERSION = "0.32.0"


def _propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
    drafter = getattr(self, "drafter", None)
    if getattr(drafter, "specrl_batch_proposer", False):
        if not isinstance(sampled_token_ids, list):   # async scheduling hands a device tensor
            raise RuntimeError("the tree proposer needs synchronous scheduling "
                               "(sampled token ids as lists); build the LLM with async_scheduling=False")
        self._draft_probs = None
        self._draft_prob_req_ids = None
        return drafter.propose_batch(self.input_batch, self.requests, sampled_token_ids)
    return _PATCH.original("propose_draft_token_ids")(self, scheduler_output, sampled_token_ids, *args, **kwargs)


def _runner():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    return GPUModelRunner


_PATCH = PinnedPatch(VERSION, _runner, ["propose_draft_token_ids"],
                     lambda originals: {"propose_draft_token_ids": _propose_draft_token_ids})
apply, revert, is_applied = _PATCH.apply, _PATCH.revert, _PATCH.is_applied
