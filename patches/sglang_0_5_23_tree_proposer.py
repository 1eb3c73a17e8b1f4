"""SGLang 0.5.23: the NGRAM speculative worker drafts from our per-prompt trees (rollout/tree_drafting/drafter.py).

How SGLang 0.5.23 drafts with `speculative_algorithm="NGRAM"` (python/sglang/srt/speculative/
ngram_worker.py): before each decode step `NGRAMWorker._prepare_for_speculative_decoding(batch)`
calls `self._prepare_draft_tokens(batch)`, which returns, for the `bs = len(batch.reqs)` requests,
`req_drafts` (bs * draft_token_num token ids) and `mask` (bs * draft_token_num**2 booleans) from its
one global n-gram corpus. Per request, node 0 is the request's last token (the verify root) and
`mask[b, i, j]` marks node j an ancestor of node i (itself included). The worker turns the mask into
positions and tree links (parent of i = the largest strict ancestor; `reconstruct_indices_from_tree_mask`),
runs one TARGET_VERIFY forward over all bs * draft_token_num nodes and verifies with `eagle_sample`
(greedy: argmax along the links; sampling: `tree_speculative_sampling_target_only` on the request's
processed distribution, temperature / top-k / top-p), then calls `self._update_ngram_corpus(batch)`.
The batch's requests are `Req` objects: `rid`, `origin_input_ids_unpadded` (the prompt ids we sent),
`output_ids`, `sampling_params.custom_params` (our opt-in dict arrives there unchanged). Under the
overlap scheduler the last round's accepted tokens are not yet in `output_ids`: they are
`batch.spec_info.accept_tokens` (bs x draft_token_num, flattened) and `accept_lens`, spliced in exactly
as upstream does (`self.enable_overlap and not batch.grammar_needs_sync()`).

The patch replaces `_prepare_draft_tokens` with ours: each request with a draft key in its
custom_params drafts from its prompt's tree (the tokens it gained since the last step are inserted
first, in flight), with the draft length and cut-off of the batch size; `_update_ngram_corpus`
becomes a no-op (SGLang's corpus is not used). SGLang's verify accepts past a stop token and past
max_new_tokens and its result processing cuts the request there afterwards (`finished_len`), and the
overlap scheduler runs a finished request's next step once more, its last run (tokens past the end
included) in spec_info: each request's max_new_tokens and stop token ids go to the drafter, which
keeps those tokens out of the trees and counters and drafts nothing past the end (`_opts`). Without
the overlap scheduler a request's last run would never reach the drafter (it learns a step's tokens
when it drafts the next, and a finished request is in no next batch): `note_request_finished`, the hook
SGLang's result processing calls on the spec worker when a step finishes a request, hands it over
(nothing twice under overlap) and releases the request's place in the drafter at once. A request
that finishes in its prefill (a stop token first, or max_new_tokens reached by the prefill's token, as
an `exact` / `lenient` extension with one token left does) is in no decode batch and
SGLang's prefill result processing calls no spec-worker hook: `Scheduler.process_batch_result` is
wrapped (`process_batch_result`) so that after an extend batch's result each request it finished
enters the trees (its response, an extension's prefix included) and the counters, once, and leaves
the drafter. A Scheduler method `specrl_tree_rpc` lets the engine read the counters and save / load the trees
through `Engine.collective_rpc`, which returns no values, so results travel through a file (TP rank 0
writes it; every rank keeps the same trees).

Mapping our chain onto SGLang's tree verify: SGLang verifies a tree of exactly draft_token_num
nodes per request. Our draft d_1..d_L (L <= draft_token_num - 1) is a chain: node j (1..L) has the
ancestors 0..j. The unused nodes L+1.. are padding with no ancestor but themselves: by the mask
contract they have no parent and no node names them a child, so verification never reaches them
(they cost compute, as upstream's padding does: SGLang's verify width is fixed at server start).
Upstream pads short matches with token 0 as *children of the root*; several such siblings carrying
the same token would each add p(0) to the target-only sampler's running acceptance sum and accept
token 0 with up to k * p(0) - not an exact sample - so our padding stays out of the tree. On a chain
the target-only sampler accepts d_j with probability p(d_j) under the processed distribution and on
a rejection samples p with d_j removed (speculative_accept_threshold_single/acc = 1, the default,
which SGLangEngine sets explicitly), so generation stays an exact sample of the policy.

Pinned to SGLang 0.5.23; `apply()` does nothing on other versions, or unless the settings variable
SPECRL_SGLANG_TREE_PROPOSER is set (SGLangEngine sets it before SGLang starts its scheduler
processes, which inherit it and apply the patch through the `sglang.srt.plugins` entry point).
"""

from __future__ import annotations

import os
import pickle
import weakref

import numpy as np

from megatron_specrl.rollout.tree_drafting.drafter import TreeDrafter, opts_from_params, read_settings
from megatron_specrl.patches.pinned import PinnedPatch

VERSION = "0.5.23"
SETTINGS_ENV = "SPECRL_SGLANG_TREE_PROPOSER"
RPC_METHOD = "specrl_tree_rpc"
RPC_CALLS = ("take_stats", "state_dict", "load_state_dict", "add_responses")
RPC_INPUTS = ("load_state_dict", "add_responses")   # calls that read their argument from the file


class _Seq:
    """prompt + output_ids + tokens accepted last round (overlap), sliced without joining them."""

    def __init__(self, *parts):
        self.parts = parts
        self.len = sum(len(p) for p in parts)

    def __call__(self, a: int, b: int) -> list[int]:
        out, base = [], 0
        for p in self.parts:
            lo, hi = max(a - base, 0), min(b - base, len(p))
            if lo < hi:
                out.extend(int(t) for t in p[lo:hi])
            base += len(p)
        return out


def drafter_of(worker) -> TreeDrafter:
    d = worker.__dict__.get("specrl_drafter")
    if d is None:
        max_len = int(worker.model_runner.model_config.context_len)
        d = worker.specrl_drafter = TreeDrafter(int(worker.draft_token_num) - 1, max_len,
                                                read_settings(os.environ.get(SETTINGS_ENV)))
    return d


def _prepare_draft_tokens(self, batch) -> tuple[np.ndarray, np.ndarray]:
    reqs = batch.reqs
    bs, n = len(reqs), int(self.draft_token_num)
    if self.enable_overlap and not batch.grammar_needs_sync():
        prev_tokens, prev_lens = batch.spec_info.accept_tokens, batch.spec_info.accept_lens
        if not prev_tokens.is_cpu:
            prev_tokens, prev_lens = prev_tokens.cpu(), prev_lens.cpu()
        self.prev_token_ids, self.prev_accept_lens = prev_tokens.tolist(), prev_lens.tolist()
        prev = [self.prev_token_ids[i * n:i * n + self.prev_accept_lens[i]] for i in range(bs)]
    else:
        self.prev_token_ids, self.prev_accept_lens = [], [0] * bs
        prev = [[] for _ in range(bs)]
    drafter = drafter_of(self)
    drafter.begin_step(bs)
    tokens = np.zeros((bs, n), dtype=np.int64)
    mask = np.zeros((bs, n, n), dtype=bool)
    idx = np.arange(n)
    mask[:, idx, idx] = True                  # every node sees itself; padding sees nothing else
    for i, req in enumerate(reqs):
        prompt = req.origin_input_ids_unpadded
        seq = _Seq(prompt, req.output_ids, prev[i])
        if req.finished():   # its result was processed before this batch ran: it has left the drafter
            draft = []
        else:
            draft = drafter.request(str(req.rid), lambda: _opts(req, len(prompt)), seq, seq.len) or []
        draft = draft[:n - 1]
        tokens[i, 0] = seq(seq.len - 1, seq.len)[0]
        tokens[i, 1:1 + len(draft)] = draft
        for j in range(1, 1 + len(draft)):    # a chain: node j's ancestors are 0..j
            mask[i, j, :j + 1] = True
    drafter.end_step(_held_since_last_step(self, reqs))
    return tokens.reshape(-1), mask.reshape(-1)


def _opts(req, prompt_len: int):
    """The request's opt-in, with where SGLang ends it. The verify (`eagle_sample`) accepts along the
    draft past a stop token and past max_new_tokens, result processing extends `output_ids` with the
    whole run and `Req.update_finish_state` then cuts `finished_len` at the first stop token or at
    max_new_tokens; under the overlap scheduler the finished request is in the next step's batch once
    more, its run (tokens past the end included) in `spec_info.accept_tokens`. Stop tokens as
    `Req._check_token_based_finish` checks them: none under ignore_eos; else the sampling params'
    stop_token_ids, the request's eos_token_ids and its tokenizer's eos_token_id and
    additional_stop_token_ids (stop strings and regexes are not tokens: not seen here)."""
    sp = req.sampling_params
    stops: set = set()
    if not getattr(sp, "ignore_eos", False):
        stops.update(getattr(sp, "stop_token_ids", None) or ())
        stops.update(getattr(req, "eos_token_ids", None) or ())
        tok = getattr(req, "tokenizer", None)
        if tok is not None:
            stops.add(getattr(tok, "eos_token_id", None))
            stops.update(getattr(tok, "additional_stop_token_ids", None) or ())
    return opts_from_params(getattr(sp, "custom_params", None), prompt_len,
                            getattr(sp, "max_new_tokens", None), stops)


def _held_since_last_step(worker, reqs) -> set[str]:
    """Ids of requests that left the decode batch without finishing. Under decode-memory pressure
    SGLang's `ScheduleBatch.retract_decode` sends requests back to the waiting queue with their
    output_ids kept (`Req.reset_for_retract` sets `is_retracted`, cleared when they are prefilled
    again): the drafter must keep their place, or their whole response would enter the trees a second
    time when they are back. Under the overlap scheduler `Scheduler._reqs_finishing_inflight` leaves
    out of the next batch a request whose next token reaches max_new_tokens
    (`Req.next_output_finishes_by_length`) while its last run is still in flight: it is held until
    that run's result finishes it (`note_request_finished`). The worker cannot see the scheduler's
    queue, so the last step's requests are held by weak reference: one the scheduler dropped (aborted
    while waiting) is gone, one that finished is over."""
    last = worker.__dict__.get("specrl_last_reqs", {})
    now = {str(r.rid) for r in reqs}
    held = {}
    for rid, ref in last.items():
        req = ref()
        if rid in now or req is None or req.finished():
            continue
        if getattr(req, "is_retracted", False) or (worker.enable_overlap and _last_token_in_flight(req)):
            held[rid] = ref
    worker.specrl_last_reqs = {**held, **{str(r.rid): weakref.ref(r) for r in reqs}}
    return set(held)


def _last_token_in_flight(req) -> bool:
    """Req.next_output_finishes_by_length, the test of Scheduler._reqs_finishing_inflight."""
    max_new = getattr(req.sampling_params, "max_new_tokens", None)
    return max_new is not None and len(req.output_ids) + 1 >= max_new


def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
    """SGLang's hook (BaseSpecWorker's no-op, which NGRAMWorker does not override) that result
    processing calls once when a decode/verify step finishes a request
    (`SchedulerBatchResultProcessor._handle_finish_state_updated_req`, after `process_batch_result_decode`
    extended `output_ids` with the step's run and `Req.update_finish_state` ended it). Without the
    overlap scheduler the drafter has not seen that run (it learns a step's tokens when it drafts the
    next, and a finished request is in no next batch): it enters the trees and the counters now, cut
    at the stop token or max_new_tokens as any step's (`_opts`). Under overlap the drafter already
    read it from spec_info when it prepared the next step, unless the request was left out of that
    step (held, `_held_since_last_step`): then it enters now; nothing enters twice. Either way the
    request's place in the drafter is released here. Only `rid` comes with the hook: the request is
    the one the last step held, by weak reference."""
    drafter = self.__dict__.get("specrl_drafter")
    if drafter is None:
        return
    ref = self.__dict__.get("specrl_last_reqs", {}).get(str(rid))
    req = ref() if ref is not None else None
    seq = None if req is None else _Seq(req.origin_input_ids_unpadded, req.output_ids)
    drafter.finish(str(rid), seq, None if seq is None else seq.len)


def process_batch_result(self, batch, result):
    """Scheduler.process_batch_result (managers/scheduler.py), around SGLang's own: after an extend
    batch's result, requests it finished in their prefill reach the drafter (`_finished_in_prefill`).

    SGLang 0.5.23 runs a prefill through `NGRAMWorker.forward_batch_generation`'s non-verify branch
    (`_prepare_for_speculative_decoding` returns at once for a batch that is not a decode batch), so
    the drafter is not called; `Scheduler.process_batch_result` hands an extend batch's result to
    `SchedulerBatchResultProcessor.process_batch_result_prefill`
    (managers/scheduler_components/batch_result_processor.py), which appends the sampled token to
    `req.output_ids`, calls `Req.update_finish_state()` and releases a finished request's KV cache - and,
    unlike `_handle_finish_state_updated_req` on the decode path, never calls the spec worker's
    `note_request_finished`. `Scheduler.get_next_batch_to_run` then filters the finished request out
    (`ScheduleBatch.filter_batch`), so it is in no decode batch and `_prepare_draft_tokens` never sees
    it: without this its response (a stop token first, or the one token max_new_tokens allowed, after
    an extension's accepted prefix) would never enter its prompt's tree or the shared tree. Under the
    overlap scheduler the prefill's requests are merged into the next decode batch before its result
    is processed: one whose next token reaches max_new_tokens is left out of it
    (`Scheduler._reqs_finishing_inflight`), any other is drafted once (its token read from spec_info)
    and held; this hands it over without entering its token again, and releases it."""
    worker = getattr(self, "draft_worker", None)
    mode = getattr(batch, "forward_mode", None)
    watched = []
    if (getattr(type(worker), "_prepare_draft_tokens", None) is _prepare_draft_tokens and mode is not None
            and not mode.is_decode() and mode.is_extend()):   # the branches that end in prefill processing
        watched = [(req, len(req.output_ids)) for req in batch.reqs if not req.finished()]
    out = _SCHEDULER.original("process_batch_result")(self, batch, result)
    for req, before in watched:
        if req.finished():
            _finished_in_prefill(worker, req, committed=len(req.output_ids) > before)
    return out


def _finished_in_prefill(worker, req, committed: bool) -> None:
    """A request that its prefill's result finished. `committed`: the prefill's token was appended
    (not a request whose output SGLang discarded: a failed KV load, an unusable sampling mask). Its
    tokens enter the trees and the counters as the drafter's `finish` takes a request's last run (cut
    at a stop token and at max_new_tokens; already seen under overlap: nothing), and its place, if it
    had one (retracted and prefilled again, or drafted once under overlap), is released. A request of
    ours the drafter never held starts and ends here, as one request step, generated_tokens its token
    (vLLM's proposer counts a request's prefill step so); a discarded one the drafter never held leaves
    nothing, and a request without a draft key creates no drafter."""
    drafter = worker.__dict__.get("specrl_drafter")
    prompt = req.origin_input_ids_unpadded
    opts = _opts(req, len(prompt)) if committed else None
    if opts is None and drafter is None:
        return
    seq = _Seq(prompt, req.output_ids)
    drafter_of(worker).finish(str(req.rid), seq, seq.len, opts=None if opts is None else (lambda: opts))


def _update_ngram_corpus(self, batch) -> None:
    """The tree took this step's tokens when it drafted; SGLang's own corpus stays unused."""


def _tp_rank() -> int:
    from sglang.srt.runtime_context import get_parallel
    return int(get_parallel().tp_rank)


def specrl_tree_rpc(self, call: str, path: str) -> None:
    """Scheduler side of SGLangEngine.draft_stats / draft_state / load_draft_state / add_to_draft_trees."""
    if call not in RPC_CALLS:
        raise ValueError(f"unknown tree call {call!r}; known: {RPC_CALLS}")
    worker = getattr(self, "draft_worker", None)
    if worker is None or not hasattr(worker, "_prepare_draft_tokens"):
        raise RuntimeError("this SGLang server runs without the NGRAM worker (rollout.draft=tree)")
    drafter = drafter_of(worker)
    if call in RPC_INPUTS:
        with open(path, "rb") as f:
            getattr(drafter, call)(pickle.load(f))
        return
    out = getattr(drafter, call)()
    if _tp_rank() == 0:
        with open(path, "wb") as f:
            pickle.dump(out, f)


def _worker():
    from sglang.srt.speculative.ngram_worker import NGRAMWorker
    return NGRAMWorker


def _scheduler():
    from sglang.srt.managers.scheduler import Scheduler
    return Scheduler


def _enabled() -> bool:
    return bool(os.environ.get(SETTINGS_ENV))


_WORKER = PinnedPatch(VERSION, _worker,
                      ["_prepare_draft_tokens", "_update_ngram_corpus", "note_request_finished"],
                      lambda originals: {"_prepare_draft_tokens": _prepare_draft_tokens,
                                         "_update_ngram_corpus": _update_ngram_corpus,
                                         "note_request_finished": note_request_finished},
                      when=_enabled, package="sglang")
_SCHEDULER = PinnedPatch(VERSION, _scheduler, [RPC_METHOD, "process_batch_result"],
                         lambda originals: {RPC_METHOD: specrl_tree_rpc, "process_batch_result": process_batch_result},
                         when=_enabled, package="sglang")


def apply() -> bool:
    return _WORKER.apply() and _SCHEDULER.apply()


def revert() -> None:
    _WORKER.revert()
    _SCHEDULER.revert()


def is_applied() -> bool:
    return _WORKER.is_applied() and _SCHEDULER.is_applied()
