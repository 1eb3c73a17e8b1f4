"""vLLM 0.32.0: let a `custom_class` speculative proposer see the runner's input batch.

Why: our draft proposer (megatron_specrl.engines.vllm.tree_proposer.TreeProposer) drafts from a
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

And it wraps `GPUModelRunner._prepare_inputs`: vLLM 0.32 takes the speculative path whenever a
speculative config exists (`use_spec_decode = self.speculative_config is not None`), so a step in
which no request has draft tokens still builds spec-decode metadata and samples through the
rejection sampler, which with zero drafts draws the same tokens as the plain sampler (logits at
each request's last position, the bonus token from the same sampler with the same generators) at
about twice its cost on this CPU. With our proposer and no draft token in the step, the metadata is
dropped and the runner samples as an engine without speculative decoding does (the logits
indices are the same: each request's last scheduled token). vLLM keeps zero-draft rows on the
speculative path for recurrent backends (GDN's decode-only CUDA graphs read a state offset only it
applies); the tree proposer drafts for attention models (Llama, Qwen2). Measured: an engine with
the tree proposer and no draft in any step ran 22% slower than one without speculative decoding
(in-process, 128 requests, the same tokens); docs/benchmarks/2026-11-25-avx512.md.

And it wraps `GPUModelRunner.execute_model` and `sample_tokens`: a step in which no request opted into
the tree proposer (none carries its draft key: a prompt's first epoch on CPU runs undrafted, and held-out
evaluation never drafts), none of its requests is still held by the drafter and no draft token is
scheduled runs with the runner's `speculative_config` set aside, so it is plain decoding's step: no
spec-decode metadata built and dropped, no proposer call over the batch, no empty drafts handed to the
scheduler (`take_draft_token_ids` has none, so `update_draft_token_ids` is skipped). Such a step had
nothing to draft, and its tokens are the plain sampler's either way (the `_prepare_inputs` wrap above
already sampled it plainly).

And it wraps `EngineCore.post_step`, which after every step asks the worker for the step's drafts
(`take_draft_token_ids`): with vLLM's multiprocess executor, as on CPU, a round trip to the worker
process every step, in which the engine core spins on the shared-memory queue. Where no running request
opted in, every draft the worker holds is empty (the proposer drafts nothing for a request without the
draft key, and a plain step proposes nothing), so the engine core skips the call. On the AVX2 EPYC,
2026-12-02 (py-spy of the engine core, first epoch, the default mode exact + tree + decode with nothing
to draft against rollout.spec_mode=off in the same process): that round trip was the largest difference
between the two engine cores (267 of 3570 samples); with both wraps the default's CPU-seconds per
first-epoch rollout went from 1.08-1.10x off's to 1.01-1.06x (CHANGELOG, 2026-12-02).

Pinned to vLLM 0.32.0; on other versions `apply()` leaves vLLM alone and returns False. Only
engines this project starts call `apply()` (VLLMEngine, before building its LLM).
"""

from __future__ import annotations

from megatron_specrl.patches.pinned import PinnedPatch

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


def _prepare_inputs(self, *args, **kwargs):
    logits_indices, spec_decode_metadata, max_num_sampled_tokens = _PATCH.original("_prepare_inputs")(
        self, *args, **kwargs)
    if (spec_decode_metadata is not None and getattr(getattr(self, "drafter", None), "specrl_batch_proposer", False)
            and not any(spec_decode_metadata.num_draft_tokens)):
        spec_decode_metadata = None      # no draft in this step: the plain sampler, as without spec decoding
    return logits_indices, spec_decode_metadata, max_num_sampled_tokens


def _plain_step(runner, scheduler_output) -> bool:
    """Whether this step has nothing for the tree proposer: no draft token scheduled, no request the
    drafter still holds (it releases ended ones in a step it sees), and no scheduled request that opted in
    (a request unknown to the runner counts as opted in)."""
    drafter = getattr(runner, "drafter", None)
    if (not getattr(drafter, "specrl_batch_proposer", False) or scheduler_output.scheduled_spec_decode_tokens
            or drafter.holds_requests()):
        return False
    new = {r.req_id: r.sampling_params for r in scheduler_output.scheduled_new_reqs}
    for req_id in scheduler_output.num_scheduled_tokens:
        params = new.get(req_id) or getattr(runner.requests.get(req_id), "sampling_params", None)
        if params is None or drafter.opts_in(params):
            return False
    return True


class _WithoutSpeculation:
    """The runner's speculative_config set aside for one call, as in an engine built without it."""

    def __init__(self, runner, plain: bool):
        self.runner, self.plain = runner, plain

    def __enter__(self):
        if self.plain:
            self.config, self.runner.speculative_config = self.runner.speculative_config, None

    def __exit__(self, *exc):
        if self.plain:
            self.runner.speculative_config = self.config


def _execute_model(self, scheduler_output, *args, **kwargs):
    self._specrl_plain_step = plain = _plain_step(self, scheduler_output)
    with _WithoutSpeculation(self, plain):
        return _PATCH.original("execute_model")(self, scheduler_output, *args, **kwargs)


def _sample_tokens(self, *args, **kwargs):
    """The second half of execute_model's step: the same decision (sample_tokens follows it)."""
    with _WithoutSpeculation(self, getattr(self, "_specrl_plain_step", False)):
        return _PATCH.original("sample_tokens")(self, *args, **kwargs)


def _post_step(self, model_executed: bool) -> None:
    """EngineCore.post_step without the worker round trip where no running request can have a draft."""
    spec = self.vllm_config.speculative_config
    if (model_executed and spec is not None and spec.method == "custom_class"
            and not any(_opts_in(r.sampling_params) for r in self.scheduler.running)):
        return
    _CORE_PATCH.original("post_step")(self, model_executed)


def _opts_in(params) -> bool:
    from megatron_specrl.engines.vllm.tree_proposer import TreeProposer
    return TreeProposer.opts_in(params)


def _engine_core():
    from vllm.v1.engine.core import EngineCore
    return EngineCore


def _runner():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    return GPUModelRunner


_PATCH = PinnedPatch(VERSION, _runner,
                     ["propose_draft_token_ids", "_prepare_inputs", "execute_model", "sample_tokens"],
                     lambda originals: {"propose_draft_token_ids": _propose_draft_token_ids,
                                        "_prepare_inputs": _prepare_inputs, "execute_model": _execute_model,
                                        "sample_tokens": _sample_tokens})
_CORE_PATCH = PinnedPatch(VERSION, _engine_core, ["post_step"], lambda originals: {"post_step": _post_step})


def apply() -> bool:
    """Both halves, the worker's runner and the engine core's step, or neither (another vLLM release)."""
    return _PATCH.apply() and _CORE_PATCH.apply()


def revert() -> None:
    _CORE_PATCH.revert()
    _PATCH.revert()


def is_applied() -> bool:
    return _PATCH.is_applied() and _CORE_PATCH.is_applied()
