"""SGLang 0.5.23's NGRAM worker and where a request ends: stop tokens and max_new_tokens.

What SGLang does (python/sglang/srt in 0.5.23):
- the verify (speculative/eagle_utils.py `eagle_sample`) accepts along the draft chain without looking
  at stop tokens or max_new_tokens, and adds the bonus token: a draft that contains a stop token,
  accepted, is followed by more accepted tokens; nothing in speculative/ reads max_new_tokens, and the
  verify width is draft_token_num whatever is left of the request;
- result processing (managers/scheduler_components/batch_result_processor.py
  `process_batch_result_decode`) extends `req.output_ids` with the whole accepted run and only then
  `Req.update_finish_state` (managers/schedule_batch.py) sets `finished_len` at the first stop token
  (stop_token_ids, eos_token_ids, tokenizer.eos_token_id, tokenizer.additional_stop_token_ids; none
  with ignore_eos) or at max_new_tokens; what is streamed is `output_ids_through_stop`;
- the overlap scheduler (managers/scheduler.py `event_loop_overlap`, SGLang's default on CUDA) builds
  and launches step N+1 before it processes step N's result, so a request whose step-N run holds the
  stop is still in step N+1's batch ("a finished row reappears for one overshoot tick"), and the
  patched `_prepare_draft_tokens` reads that run, tokens past the stop included, from
  `batch.spec_info.accept_tokens`. (`Scheduler._reqs_finishing_inflight` drops only requests whose
  next single token reaches max_new_tokens, so a run that crosses max_new_tokens reappears too.)

The fakes are those of tests/test_sglang_tree_proposer.py; `Req` here also carries the fields
`Req._check_token_based_finish` and `update_finish_state` read, with SGLang's defaults.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from patches import sglang_0_5_23_tree_proposer as patch
import test_sglang_tree_proposer as base
from test_sglang_tree_proposer import Batch, greedy_verify, make_worker, step

fake_sglang = base.fake_sglang     # the fixture: a fake `sglang` with the classes the patch targets


class Req(base.Req):
    """SamplingParams' max_new_tokens / stop_token_ids / ignore_eos (defaults 128, None, False), the
    request's eos_token_ids (the model config's) and the scheduler's tokenizer (None without one)."""

    def __init__(self, rid, prompt, key=None, max_new_tokens=128, stop_token_ids=None, ignore_eos=False,
                 eos_token_ids=None, tokenizer=None, **kw):
        super().__init__(rid, prompt, key, **kw)
        self.sampling_params.max_new_tokens = max_new_tokens
        self.sampling_params.stop_token_ids = stop_token_ids
        self.sampling_params.ignore_eos = ignore_eos
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer


def accepted_run(batch, b, tokens):
    """The overlap scheduler's view of step N's result at step N+1's draft preparation."""
    n = batch.n
    batch.spec_info.accept_tokens[b * n:b * n + len(tokens)] = torch.tensor(tokens)
    batch.spec_info.accept_lens[b] = len(tokens)


def test_tokens_after_a_stop_in_the_overshoot_tick_enter_no_tree_and_no_counter(fake_sglang):
    """Overlap scheduler: step N accepts 2 EOS and the bonus after it; SGLang ends the request at the
    EOS, but the request is in step N+1's batch and its run, bonus included, reaches the drafter."""
    assert patch.apply()
    w = make_worker(fake_sglang, overlap=True)
    d = patch.drafter_of(w)
    for _ in range(3):
        d.trees.insert("q", [1, 2, 99, 5, 6, 7])
    b = Batch([Req("a", [50, 51], "q", eos_token_ids={99})], n=5)
    accepted_run(b, 0, [1])                                  # the prefill's token, not yet in output_ids
    first = step(w, b)
    assert first == [[2, 99]]                                # SGLang would end the request at 99
    run = greedy_verify(first[0], [2, 99, 5, 6, 7, 8])      # the target agrees: 2 99, bonus 5
    b.reqs[0].output_ids.append(1)                           # step N-1 processed
    accepted_run(b, 0, run)                                  # step N's run, still in flight
    assert step(w, b) == [[]]                                # the request ended: no draft
    assert d.trees.count("q", [1, 2, 99]) == 4 and d.trees.count("q", [1, 2, 99, 5]) == 3
    stats = d.take_stats()
    assert stats["generated_tokens"] == 1 + 2 and stats["accepted_tokens"] == 2
    assert stats["draft_tokens"] == 2


def test_a_run_past_max_new_tokens_is_cut_there_and_drafts_stop_at_it(fake_sglang):
    """max_new_tokens=4: one token out, at most 4 - 1 - 1 = 2 draft tokens can be kept (the verify adds
    the bonus); the overshoot tick's run past the 4th token enters nothing."""
    assert patch.apply()
    w = make_worker(fake_sglang, overlap=True)
    d = patch.drafter_of(w)
    d.trees.insert("q", list(range(100, 120)))
    b = Batch([Req("a", [1], "q", max_new_tokens=4)], n=5)
    accepted_run(b, 0, [100])
    assert step(w, b) == [[101, 102]]
    b.reqs[0].output_ids.append(100)
    # a draft of 4 (as without the cap) accepted whole: output_ids would hold 6 tokens, SGLang keeps 4
    accepted_run(b, 0, [101, 102, 103, 104, 105])
    assert step(w, b) == [[]]
    assert d.trees.count("q", list(range(100, 104))) == 2 and d.trees.count("q", list(range(100, 105))) == 1
    stats = d.take_stats()
    assert stats["generated_tokens"] == 4 and stats["draft_tokens"] == 2


def test_drafts_stop_at_the_remaining_max_new_tokens_without_overlap(fake_sglang):
    assert patch.apply()
    w = make_worker(fake_sglang, draft_token_num=9)
    patch.drafter_of(w).trees.insert("q", list(range(100, 120)))
    b = Batch([Req("a", [1], "q", max_new_tokens=5), Req("b", [1], "q", max_new_tokens=1000)], n=9)
    for r in b.reqs:
        r.output_ids.extend([100, 101])
    assert step(w, b) == [[102, 103], list(range(102, 110))]


def test_stop_tokens_are_those_sglang_checks(fake_sglang):
    """Req._check_token_based_finish: sampling stop_token_ids, the request's eos_token_ids, the
    tokenizer's eos_token_id and additional_stop_token_ids; none of them under ignore_eos."""
    assert patch.apply()
    w = make_worker(fake_sglang)
    patch.drafter_of(w).trees.insert("q", [1, 2, 3, 4, 5, 6])
    tok = SimpleNamespace(eos_token_id=4, additional_stop_token_ids={5})
    reqs = [Req("stop", [9], "q", stop_token_ids={2}, eos_token_ids={3}, tokenizer=tok),
            Req("eos", [9], "q", eos_token_ids={3}, tokenizer=tok),
            Req("tok", [9], "q", tokenizer=tok),
            Req("extra", [9], "q", tokenizer=SimpleNamespace(eos_token_id=None, additional_stop_token_ids={5})),
            Req("ignore", [9], "q", stop_token_ids={2}, eos_token_ids={3}, tokenizer=tok, ignore_eos=True),
            Req("none", [9], "q")]
    for r in reqs:
        r.output_ids.append(1)
    assert step(w, Batch(reqs, n=5)) == [[2], [2, 3], [2, 3, 4], [2, 3, 4, 5], [2, 3, 4, 5], [2, 3, 4, 5]]
