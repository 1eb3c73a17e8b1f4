"""SGLang 0.5.23's NGRAM worker and a request's last verify step: its tokens reach the drafter once.

What SGLang does (python/sglang/srt in 0.5.23):
- the drafter learns a request's tokens when the worker prepares its next step's drafts
  (`NGRAMWorker._prepare_draft_tokens`); result processing of a decode/verify batch
  (managers/scheduler_components/batch_result_processor.py `process_batch_result_decode`) extends
  `req.output_ids` with the accepted run, `Req.update_finish_state` ends it (stop token, max_new_tokens,
  `to_finish` for aborts), and `_handle_finish_state_updated_req` then calls
  `draft_worker.note_request_finished(rid=..., natural_stop=...)` on the spec worker (a no-op in
  `BaseSpecWorker`, which NGRAMWorker does not override);
- without the overlap scheduler a finished request is filtered out before the next batch, so its last
  run would never be shown to the drafter; with it (`event_loop_overlap`) step N+1 is launched (its
  drafts prepared, step N's run read from `spec_info`) before step N's result is processed, so the
  finished request is shown once more, and processing of its overshoot tick skips it (`continue` on
  `req.finished()` under overlap) - unless `Scheduler._reqs_finishing_inflight` left it out of step
  N+1 (its next token reaches max_new_tokens: `Req.next_output_finishes_by_length`);
- when overlap is disabled for one batch (`is_disable_overlap_for_batch`, e.g. a grammar sync) the last
  result is processed after the next batch was built and before it is launched: a request finished by
  that processing is in the batch whose drafts are then prepared.

The fakes are those of tests/test_sglang_tree_proposer.py and tests/test_review_sglang_stops.py; `Req`
here also carries `finished_len`, `to_finish`, `update_finish_state` and
`next_output_finishes_by_length` as SGLang's Req has them (the token- and length-based parts), and
`process_decode_result` is `process_batch_result_decode` reduced to what reaches the drafter.
"""

from __future__ import annotations

from megatron_specrl.engines.tree_drafter import SHARED_KEY
from patches import sglang_0_5_23_tree_proposer as patch
import test_review_sglang_stops as stops
import test_sglang_tree_proposer as base
from test_review_sglang_stops import accepted_run
from test_sglang_tree_proposer import Batch, greedy_verify, make_worker, step

fake_sglang = base.fake_sglang     # the fixture: a fake `sglang` with the classes the patch targets


class MatchedToken(str):
    """FINISH_MATCHED_TOKEN (natural_stop in note_request_finished)."""


class Req(stops.Req):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.finished_len, self.to_finish = None, None

    def _stops(self):
        if self.sampling_params.ignore_eos:
            return set()
        out = set(self.sampling_params.stop_token_ids or ()) | set(self.eos_token_ids or ())
        if self.tokenizer is not None:
            out |= {self.tokenizer.eos_token_id, *(self.tokenizer.additional_stop_token_ids or ())}
        return out

    def update_finish_state(self, new_accepted_len=1):
        """Req.update_finish_state: to_finish, then stop tokens in the new run (finished_len at the first,
        capped at max_new_tokens), then the length."""
        if self.finished():
            return
        if self.to_finish:
            self.finished_reason, self.to_finish = self.to_finish, None
            return
        max_new = self.sampling_params.max_new_tokens
        new = list(self.output_ids[len(self.output_ids) - new_accepted_len:])
        for i, t in enumerate(new):
            if t in self._stops():
                self.finished_reason = MatchedToken("stop")
                self.finished_len = len(self.output_ids) - len(new) + i + 1
                if self.finished_len > max_new:
                    self.finished_reason, self.finished_len = "length", max_new
                return
        if len(self.output_ids) >= max_new:
            self.finished_reason, self.finished_len = "length", max_new

    def next_output_finishes_by_length(self):
        return len(self.output_ids) + 1 >= self.sampling_params.max_new_tokens

    @property
    def output_ids_through_stop(self):
        return self.output_ids if self.finished_len is None else self.output_ids[:self.finished_len]


class GrammarBatch(Batch):
    def grammar_needs_sync(self):
        return True


def process_decode_result(worker, batch, runs, overlap):
    """process_batch_result_decode for a spec batch: each request's accepted run (drafts + bonus)."""
    for req, run in zip(batch.reqs, runs):
        if overlap and (req.finished() or req.is_retracted):
            continue                          # the overshoot tick of a request finished last round
        req.output_ids.extend(run)
        req.update_finish_state(len(run))
        if req.finished():                    # _handle_finish_state_updated_req
            if hasattr(type(worker), "note_request_finished"):   # else BaseSpecWorker's no-op
                worker.note_request_finished(rid=req.rid,
                                             natural_stop=isinstance(req.finished_reason, MatchedToken))


def active(d):
    return d.trees.stats()["active_requests"]


def test_without_overlap_the_last_runs_tokens_enter_the_trees_up_to_the_stop(fake_sglang):
    """Sync scheduler: the last verify step accepts 2 3 EOS and a bonus past the EOS; the request is
    filtered out before the next batch. Its tokens through the EOS enter its prompt's tree and the
    shared tree, the bonus does not, the counters take the step, and its place is released at once."""
    assert patch.apply()
    w = make_worker(fake_sglang)
    d = patch.drafter_of(w)
    for _ in range(3):
        d.trees.insert("q", [1, 2, 3, 99, 5])
    a = Req("a", [50, 51], "q", eos_token_ids={99})
    a.output_ids.append(1)                                    # the prefill's token
    b = Batch([a], n=5)
    first = step(w, b)
    assert first == [[2, 3, 99]]                              # drafts stop at the stop token
    run = greedy_verify(first[0], [2, 3, 99, 7, 8])
    assert run == [2, 3, 99, 7]                               # SGLang accepts the bonus past the EOS
    process_decode_result(w, b, [run], overlap=False)
    assert a.finished() and a.finished_len == 4
    assert d.trees.count("q", [1, 2, 3, 99]) == 4 and d.trees.count("q", [99, 7]) == 0
    assert d.trees.count(SHARED_KEY, [1, 2, 3, 99]) == 1 and d.trees.count(SHARED_KEY, [99, 7]) == 0
    assert active(d) == 0                                     # released without waiting for a next step
    stats = d.take_stats()
    assert stats["generated_tokens"] == 1 + 3 and stats["accepted_tokens"] == 3
    assert stats["request_steps"] == 2 and stats["draft_tokens"] == 3
    step(w, Batch([Req("other", [3])], n=5))                  # the next batch: nothing more of a
    assert d.trees.count("q", [1, 2, 3, 99]) == 4 and d.take_stats()["generated_tokens"] == 0


def test_without_overlap_a_run_past_max_new_tokens_enters_up_to_it(fake_sglang):
    """max_new_tokens=4 and a run that crosses it (the draft was cut to what is left: 4 - 1 - 1 = 2, the
    verify adds the bonus): the request's 4 tokens enter, nothing past them."""
    assert patch.apply()
    w = make_worker(fake_sglang)
    d = patch.drafter_of(w)
    d.trees.insert("q", list(range(100, 120)))
    a = Req("a", [1], "q", max_new_tokens=4)
    a.output_ids.append(100)
    b = Batch([a], n=5)
    assert step(w, b) == [[101, 102]]
    process_decode_result(w, b, [[101, 102, 103, 104]], overlap=False)   # as if SGLang ran past it
    assert a.finished() and a.finished_len == 4
    assert d.trees.count("q", [100, 101, 102, 103]) == 2 and d.trees.count("q", [103, 104]) == 1
    stats = d.take_stats()
    assert stats["generated_tokens"] == 4 and stats["accepted_tokens"] == 2 and active(d) == 0


def test_with_overlap_the_last_run_counts_once_and_the_place_is_released(fake_sglang):
    """Overlap scheduler: the drafter took step N's run (stop included, past it cut) when it prepared
    step N+1, which still holds the request; processing step N then finishes it. Nothing enters twice,
    and its place is released then, not a step later."""
    assert patch.apply()
    w = make_worker(fake_sglang, overlap=True)
    d = patch.drafter_of(w)
    for _ in range(3):
        d.trees.insert("q", [1, 2, 99, 5, 6, 7])
    a, c = Req("a", [50, 51], "q", eos_token_ids={99}), Req("c", [50, 51], "q")
    b = Batch([a, c], n=5)
    accepted_run(b, 0, [1])                                   # the prefill's tokens, not yet in output_ids
    accepted_run(b, 1, [1])
    assert step(w, b) == [[2, 99], [2, 99, 5, 6]]             # step N's drafts (c has no stop token)
    for r in (a, c):
        r.output_ids.append(1)                                # the prefill's result processed
    runs = [greedy_verify([2, 99], [2, 99, 5, 6]), greedy_verify([2, 99, 5, 6], [2, 3, 4, 5, 6])]
    assert runs == [[2, 99, 5], [2, 3]]
    accepted_run(b, 0, runs[0])
    accepted_run(b, 1, runs[1])
    assert step(w, b)[0] == []                                # step N+1 (a's overshoot tick) launched
    process_decode_result(w, b, runs, overlap=True)           # step N's result: a finishes
    assert a.finished() and not c.finished()
    assert d.trees.count("q", [1, 2, 99]) == 4 and d.trees.count("q", [99, 5]) == 3
    assert active(d) == 2                                     # c only, in its prompt's and the shared tree
    process_decode_result(w, b, [[7], [4]], overlap=True)     # step N+1's result: a's row skipped
    step(w, Batch([c], n=5))
    assert d.trees.count("q", [1, 2, 99]) == 4 and d.trees.count("q", [99, 5]) == 3
    stats = d.take_stats()
    assert stats["generated_tokens"] == 2 * 1 + 2 + 2 + 1 and stats["accepted_tokens"] == 2 + 1


def test_with_overlap_a_request_left_out_of_the_next_step_is_held_for_its_last_token(fake_sglang):
    """Overlap scheduler: a request whose next token reaches max_new_tokens is left out of step N+1
    (`_reqs_finishing_inflight`), so the drafter does not see it when it prepares that step; its step-N
    token arrives when step N's result finishes it."""
    assert patch.apply()
    w = make_worker(fake_sglang, overlap=True)
    d = patch.drafter_of(w)
    d.trees.insert("q", list(range(100, 120)))
    a, c = Req("a", [1], "q", max_new_tokens=2), Req("c", [1], "q")
    bn = Batch([a, c], n=5)
    accepted_run(bn, 0, [100])
    accepted_run(bn, 1, [100])
    assert step(w, bn) == [[], [101, 102, 103, 104]]          # a has one token left: no draft
    for r in (a, c):
        r.output_ids.append(100)
    assert a.next_output_finishes_by_length()                 # left out of step N+1
    bn1 = Batch([c], n=5)
    accepted_run(bn1, 0, [101, 102, 103, 104, 105])
    step(w, bn1)
    assert active(d) == 4                                     # a waits for its result: still held
    process_decode_result(w, bn, [[101], [101, 102, 103, 104, 105]], overlap=True)
    assert a.finished() and a.finished_len == 2
    assert d.trees.count("q", [100, 101]) == 3 and active(d) == 2
    stats = d.take_stats()
    assert stats["generated_tokens"] == (1 + 1) + (1 + 5) and stats["accepted_tokens"] == 4


def test_a_request_finished_before_its_batch_is_drafted_is_not_started_again(fake_sglang):
    """Overlap disabled for a batch (grammar sync): step N's result is processed after step N+1 was
    built, so the request it finishes is in step N+1's batch; its tokens arrived when it finished and
    must not enter again (its place was released: it would start over with its whole response)."""
    assert patch.apply()
    w = make_worker(fake_sglang, overlap=True)
    d = patch.drafter_of(w)
    d.trees.insert("q", [1, 2, 99, 5])
    a, c = Req("a", [50], "q", eos_token_ids={99}), Req("c", [50], "q")
    for r in (a, c):
        r.output_ids.append(1)
    b = GrammarBatch([a, c], n=5)
    assert step(w, b) == [[2, 99], [2, 99, 5]]
    process_decode_result(w, b, [[2, 99, 5], [2, 3]], overlap=True)
    assert a.finished() and d.trees.count("q", [1, 2, 99]) == 2
    generated = d.take_stats()["generated_tokens"]
    assert generated == 1 + 2 + 1                             # a's last run (through 99) and c's first token
    assert step(w, b)[0] == []                                # a is in the batch once more: no draft
    assert d.trees.count("q", [1, 2, 99]) == 2 and d.trees.count("q", [1]) == 3
    assert d.take_stats()["generated_tokens"] == 2 and active(d) == 2   # c's run only; c alone is live


def test_a_request_ended_otherwise_drafts_nothing_at_its_end(fake_sglang):
    """An abort (`to_finish`) ends a request with no stop token and room left: its last run enters,
    and no draft is made or counted for it."""
    assert patch.apply()
    w = make_worker(fake_sglang)
    d = patch.drafter_of(w)
    for _ in range(2):
        d.trees.insert("q", [1, 2, 3, 4, 5, 6, 7])
    a = Req("a", [50], "q")
    a.output_ids.append(1)
    b = Batch([a], n=5)
    assert step(w, b) == [[2, 3, 4, 5]]
    a.to_finish = "abort"
    process_decode_result(w, b, [[2, 3, 9]], overlap=False)
    assert a.finished() and d.trees.count("q", [1, 2, 3, 9]) == 1 and active(d) == 0
    stats = d.take_stats()
    assert stats["draft_tokens"] == 4 and stats["accepted_tokens"] == 2 and stats["generated_tokens"] == 4


def test_the_hook_is_pinned_reversible_and_quiet_for_others(fake_sglang):
    """note_request_finished is the patched method (added to NGRAMWorker, removed on revert); it does
    nothing for requests that did not opt in, that the drafter never saw, or before any draft."""
    W = fake_sglang.NGRAMWorker
    assert patch.apply()
    assert W.note_request_finished is patch.note_request_finished
    w = make_worker(fake_sglang)
    w.note_request_finished(rid="never", natural_stop=True)
    assert "specrl_drafter" not in w.__dict__                 # no drafter made for it
    d = patch.drafter_of(w)
    plain = Req("plain", [50], custom={"other": 1})
    plain.output_ids.append(1)
    b = Batch([plain], n=5)
    assert step(w, b) == [[]]
    process_decode_result(w, b, [[2]], overlap=False)
    plain.finished_reason = "length"
    w.note_request_finished(rid="plain", natural_stop=False)
    w.note_request_finished(rid="unknown", natural_stop=False)
    assert d.take_stats()["generated_tokens"] == 0 and d.trees.stats()["keys"] == 0
    patch.revert()
    assert not hasattr(W, "note_request_finished")
