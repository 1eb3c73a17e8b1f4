"""SGLang 0.5.23's NGRAM worker and a request that finishes in its prefill: its response reaches the trees once.

What SGLang does (python/sglang/srt in 0.5.23):
- a prefill runs through `NGRAMWorker.forward_batch_generation`'s non-verify branch
  (`_prepare_for_speculative_decoding` returns at once for a batch that is not a decode batch): the
  drafter is not called;
- `Scheduler.process_batch_result` (managers/scheduler.py) hands an extend batch's result to
  `SchedulerBatchResultProcessor.process_batch_result_prefill`
  (managers/scheduler_components/batch_result_processor.py), which skips requests already finished or
  retracted, appends the sampled token to `req.output_ids` and calls `Req.update_finish_state()` (a
  discarded output - failed KV load, unusable sampling mask - finishes the request through `to_finish`
  without appending); unlike the decode path it never calls the spec worker's `note_request_finished`;
- without the overlap scheduler the result is processed before the next batch is built and
  `get_next_batch_to_run` filters the finished request out: it is in no decode batch; with it
  (`event_loop_overlap`) the prefill's requests are merged into the next decode batch before the
  prefill's result is processed, except those whose next token reaches max_new_tokens
  (`Scheduler._reqs_finishing_inflight`): a stop-token-first request is drafted once (its token read
  from spec_info) before its prefill's result finishes it; when overlap is disabled for a batch (a
  grammar sync) the prefill's result is processed after the next batch was built, before it runs.

The fakes are those of tests/test_sglang_final_step.py; the fake Scheduler's `process_batch_result`
dispatches as SGLang's does, to `process_prefill_result` (`process_batch_result_prefill` reduced to what
reaches the drafter) or to the decode processing of tests/test_sglang_final_step.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_specrl.engines.tree_drafter import SHARED_KEY
from patches import sglang_0_5_23_tree_proposer as patch
import test_sglang_final_step as final
import test_sglang_tree_proposer as base
from test_review_sglang_stops import accepted_run
from test_sglang_final_step import Req, active
from test_sglang_tree_proposer import Batch, make_worker, step

fake_sglang = base.fake_sglang     # the fixture: a fake `sglang` with the classes the patch targets

EXTEND = SimpleNamespace(is_decode=lambda: False, is_extend=lambda: True)
DECODE = SimpleNamespace(is_decode=lambda: True, is_extend=lambda: False)


class Prefill:
    def __init__(self, reqs):
        self.reqs, self.forward_mode = reqs, EXTEND


class Decode(Batch):
    forward_mode = DECODE


class GrammarDecode(Decode):
    def grammar_needs_sync(self):
        return True


def process_prefill_result(batch, tokens):
    """process_batch_result_prefill for whole prefills: None is a discarded output (`to_finish`)."""
    for req, tok in zip(batch.reqs, tokens):
        if req.finished() or req.is_retracted:
            continue
        if tok is None:
            req.to_finish = "abort"
            req.update_finish_state(0)
            continue
        req.output_ids.append(tok)
        req.update_finish_state()


def sglang_process_batch_result(self, batch, result):
    """Scheduler.process_batch_result's dispatch."""
    if batch.forward_mode.is_decode():
        final.process_decode_result(self.draft_worker, batch, result, overlap=self.draft_worker.enable_overlap)
    elif batch.forward_mode.is_extend():
        process_prefill_result(batch, result)


@pytest.fixture
def scheduler(fake_sglang, monkeypatch):
    """A patched fake scheduler whose process_batch_result is SGLang's dispatch; sync by default."""
    monkeypatch.setattr(fake_sglang.Scheduler, "process_batch_result", sglang_process_batch_result, raising=False)
    assert patch.apply()

    def make(overlap=False):
        s = fake_sglang.Scheduler()
        s.draft_worker = make_worker(fake_sglang, overlap=overlap)
        return s
    return make


def no_state(d):
    return not d._live and not d._own and not d._unverified and active(d) == 0


def test_a_stop_token_first_or_max_new_tokens_reached_enters_the_trees_once(scheduler):
    """Sync scheduler: a stop token first and max_new_tokens=1 finish their requests in the prefill; their
    tokens enter the prompt's and the shared tree, as one request step each, and no place is kept. The
    first requests ever to finish so create the drafter; one without a draft key, and one whose output
    SGLang discarded, enter nothing. A request that goes on to decode and finishes there is not
    entered twice (note_request_finished takes it, the prefill hook does not)."""
    s = scheduler()
    w = s.draft_worker
    a = Req("a", [50, 51], "q", eos_token_ids={99})
    b = Req("b", [50, 51], "q", max_new_tokens=1)
    plain = Req("plain", [50, 51], custom={"other": 1}, max_new_tokens=1)
    gone = Req("gone", [50, 51], "q")
    c = Req("c", [50, 51], "q", eos_token_ids={99})
    s.process_batch_result(Prefill([a, b, plain, gone, c]), [99, 7, 7, None, 7])
    assert a.finished() and b.finished() and plain.finished() and gone.finished() and not c.finished()
    assert "specrl_drafter" in w.__dict__
    d = patch.drafter_of(w)
    assert d.trees.count("q", [99]) == 1 and d.trees.count(SHARED_KEY, [99]) == 1
    assert d.trees.count("q", [7]) == 1 and d.trees.count(SHARED_KEY, [7]) == 1   # b only (c: not yet)
    assert d.trees.stats()["sequences"] == 4                  # a and b, each in two trees
    assert no_state(d)
    stats = d.take_stats()
    assert stats["generated_tokens"] == 2 and stats["request_steps"] == 2
    assert stats["accepted_tokens"] == 0 and stats["draft_tokens"] == 0 and stats["proposed_tokens"] == 0
    assert stats["engine_steps"] == 0                         # no decode step ran
    bc = Decode([c], n=5)
    step(w, bc)                                               # c decodes; a and b are in no batch
    s.process_batch_result(bc, [[99]])                        # c finishes in decode
    assert c.finished() and d.trees.count("q", [7]) == 2 and d.trees.count("q", [7, 99]) == 1
    assert d.trees.count("q", [99]) == 2 and no_state(d)
    stats = d.take_stats()
    assert stats["generated_tokens"] == 2 and stats["request_steps"] == 2


def test_an_extension_whose_prefix_is_the_whole_old_response_feeds_later_drafts(scheduler):
    """exact / lenient: the extension's prompt ends with last epoch's whole response (1 2 3 4, accepted)
    and one token is left (max_new_tokens=1): its prefill samples 5 and ends it. Its response, prefix
    and token, enters the prompt's and the shared tree; a later request of the prompt drafts through
    it. Only the new token counts as generated; a lenient extension ending at a stop token enters too."""
    s = scheduler()
    w = s.draft_worker
    d = patch.drafter_of(w)
    d.trees.insert("q", [1, 2, 3, 4])                         # last epoch's response
    d.trees.insert(SHARED_KEY, [1, 2, 3, 4])
    ext = Req("ext", [50, 51, 1, 2, 3, 4], "q", response_start=2, max_new_tokens=1)
    stop = Req("stop", [50, 51, 1, 2], "q", response_start=2, eos_token_ids={99})
    s.process_batch_result(Prefill([ext, stop]), [5, 99])
    assert ext.finished() and stop.finished()
    assert d.trees.count("q", [1, 2, 3, 4, 5]) == 1 and d.trees.count(SHARED_KEY, [1, 2, 3, 4, 5]) == 1
    assert d.trees.count("q", [1, 2, 3, 4]) == 2 and d.trees.count("q", [1, 2, 99]) == 1
    assert no_state(d)
    stats = d.take_stats()
    assert stats["generated_tokens"] == 2 and stats["request_steps"] == 2
    later = Req("later", [50, 51], "q")
    later.output_ids.append(1)
    assert step(w, Decode([later], n=5)) == [[2, 3, 4, 5]]   # 5 after 4: only the extension saw it


def test_under_overlap_a_request_drafted_before_its_prefill_result_counts_once_and_is_released(scheduler):
    """Overlap scheduler: the prefill's requests join the next decode step before its result is
    processed. a (a stop token first) is in that step, its token read from spec_info; b
    (max_new_tokens=1) is left out of it (`_reqs_finishing_inflight`). Processing the prefill's result
    finishes both: a's token is not entered again and its place is released then, b's enters; the
    decode step's result skips a, and later steps add nothing of either."""
    s = scheduler(overlap=True)
    w = s.draft_worker
    d = patch.drafter_of(w)
    d.trees.insert("q", [1, 2, 3])
    a = Req("a", [50, 51], "q", eos_token_ids={99})
    b = Req("b", [50, 51], "q", max_new_tokens=1)
    c = Req("c", [50, 51], "q")
    prefill = Prefill([a, b, c])                              # launched; its result is not processed yet
    assert b.next_output_finishes_by_length()                 # left out of the next decode step
    n1 = Decode([a, c], n=5)
    accepted_run(n1, 0, [99])
    accepted_run(n1, 1, [1])
    assert step(w, n1) == [[], [2, 3]]                        # a ended at its stop token: no draft
    assert active(d) == 4
    s.process_batch_result(prefill, [99, 7, 1])               # the prefill's result
    assert a.finished() and b.finished() and not c.finished()
    assert d.trees.count("q", [99]) == 1 and d.trees.count(SHARED_KEY, [99]) == 1
    assert d.trees.count("q", [7]) == 1 and d.trees.count(SHARED_KEY, [7]) == 1
    assert active(d) == 2 and set(d._live) == {"c"}          # c only, in its prompt's and the shared tree
    s.process_batch_result(n1, [[99, 5], [2, 3, 4]])          # the decode step's result: a's row skipped
    n2 = Decode([c], n=5)                                     # (its own run already processed here)
    step(w, n2)
    assert d.trees.count("q", [99]) == 1 and d.trees.count("q", [7]) == 1
    stats = d.take_stats()
    assert stats["generated_tokens"] == 1 + 1 + 1 + 3 and stats["request_steps"] == 4
    assert stats["accepted_tokens"] == 2


def test_a_prefill_result_processed_before_the_next_step_is_drafted_is_not_started_again(scheduler):
    """Overlap disabled for a batch (a grammar sync): the prefill's result is processed after the next
    decode batch was built, so the request it finished is in that batch; it entered once, when it
    finished, and is neither entered again nor given a place."""
    s = scheduler(overlap=True)
    w = s.draft_worker
    a = Req("a", [50, 51], "q", eos_token_ids={99})
    c = Req("c", [50, 51], "q")
    prefill = Prefill([a, c])
    s.process_batch_result(prefill, [99, 1])
    d = patch.drafter_of(w)
    assert d.trees.count("q", [99]) == 1 and no_state(d)
    assert step(w, GrammarDecode([a, c], n=5))[0] == []
    assert d.trees.count("q", [99]) == 1 and set(d._live) == {"c"}
    stats = d.take_stats()
    assert stats["generated_tokens"] == 2 and stats["request_steps"] == 2


def test_a_retracted_request_finishing_in_its_new_prefill_enters_its_last_tokens_once(scheduler):
    """A request retracted under decode-memory pressure keeps its output_ids and its place in the
    drafter; prefilled again (is_retracted cleared), its prefill's token may finish it: the run the
    drafter had not yet seen and that token enter, nothing twice, and its place is released."""
    s = scheduler()
    w = s.draft_worker
    d = patch.drafter_of(w)
    a, c = Req("a", [50], "q", eos_token_ids={99}), Req("c", [50], "q")
    a.output_ids.append(1)
    c.output_ids.append(1)
    b = Decode([a, c], n=5)
    step(w, b)
    s.process_batch_result(b, [[2, 3], [2]])                  # a's run 2 3: not yet seen by the drafter
    a.is_retracted = True                                     # retracted: back to the waiting queue
    step(w, Decode([c], n=5))
    assert active(d) == 4                                     # a's place is kept
    a.is_retracted = False                                    # prepare_for_extend of its new prefill
    s.process_batch_result(Prefill([a]), [99])
    assert a.finished() and d.trees.count("q", [1, 2, 3, 99]) == 1 and d.trees.count("q", [1, 2, 3]) == 1
    assert active(d) == 2 and set(d._live) == {"c"}
    stats = d.take_stats()
    assert stats["generated_tokens"] == 1 + 1 + 1 + 3 and stats["request_steps"] == 2 + 1 + 1


def test_the_wrapper_is_pinned_and_reversible(scheduler, fake_sglang):
    """Scheduler.process_batch_result is wrapped while the patch is applied and SGLang's own after revert;
    a scheduler without our NGRAM worker (no speculative decoding) is passed straight through."""
    S = fake_sglang.Scheduler
    assert S.process_batch_result is patch.process_batch_result
    plain = S()
    plain.draft_worker = None
    r = Req("r", [1], "q", max_new_tokens=1)
    plain.process_batch_result(Prefill([r]), [5])
    assert r.finished() and list(r.output_ids) == [5]
    patch.revert()
    assert S.process_batch_result is sglang_process_batch_result
