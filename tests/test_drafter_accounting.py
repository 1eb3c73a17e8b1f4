"""The tree drafter's counters count what the engine verified, and every request's end reaches it once.

1. vLLM verifies a draft in the step after the one that proposed it, and its scheduler may verify fewer
   of its tokens (cut to the step's token budget or max_model_len) or none (a preempted request):
   draft_tokens (accept_rate's denominator) and the own / shared draft counters count the verified
   tokens (`TreeDrafter.request(..., verified=)`; the proposer reads them from the runner's
   `InputBatch.spec_token_ids`), proposed_tokens everything proposed.
2. SGLang: a request that finishes in its prefill (max_new_tokens=1, a stop token first) is in no decode
   step, so the drafter never held it: `TreeDrafter.finish(..., opts=)` starts it there and its tokens
   enter the trees; a second finish of one request does nothing.
Engine-free: the drafter and the proposer with a fake input batch, as tests/test_tree_proposer.py.
"""

from types import SimpleNamespace

import numpy as np

from megatron_specrl.engines import tree_proposer as tp
from megatron_specrl.engines.tree_drafter import RequestOpts, TreeDrafter

PROMPT = [50, 51]


def _seq(tokens):
    return lambda a, b: tokens[a:b]


def _opts(**kw):
    return lambda: RequestOpts("q", len(PROMPT), len(PROMPT), **kw)


def _step(d, reqs):
    """One engine step: reqs = [(req_id, tokens, gained, verified, opts)]; returns the drafts."""
    d.begin_step(len(reqs))
    out = [d.request(r, opts, _seq(toks), len(toks), gained, verified) for r, toks, gained, verified, opts in reqs]
    d.end_step()
    return out


def test_drafts_count_as_the_engine_verified_them():
    d = TreeDrafter(4, 256, {"min_prob": 0.0})
    a, b = PROMPT + [1, 2, 3, 4, 5], PROMPT + [1]
    # a's first five tokens are in the tree; b, at its first token, drafts a's path
    first = _step(d, [("a", a, 5, 0, _opts()), ("b", b, 1, 0, _opts())])
    assert first[1] == [2, 3, 4, 5]
    # the scheduler cut b's draft to 2 tokens (token budget): both accepted, then a recovered token
    a, b = a + [6], b + [2, 3, 9]
    second = _step(d, [("a", a, 1, len(first[0]), _opts()), ("b", b, 3, 2, _opts())])
    stats = d.take_stats()
    assert stats["accepted_tokens"] == 2
    assert stats["draft_tokens"] == 2 + len(first[0])       # the verified tokens, not the 4 proposed
    assert stats["proposed_tokens"] == sum(map(len, first + second))
    assert stats["accepted_tokens"] / stats["draft_tokens"] == 1.0
    # a draft the scheduler dropped (preempted request: 0 verified) or that never reached a step
    # (the request ended) is not counted as drafted
    a = a + [7]
    _step(d, [("a", a, 1, 0, _opts())])
    d.begin_step(0)
    d.end_step()                    # a and b ended: their last drafts were never verified
    stats = d.take_stats()
    assert stats["draft_tokens"] == 0
    assert not d._unverified


def test_own_draft_counts_its_verified_tokens():
    d = TreeDrafter(4, 256, {"min_prob": 0.0})
    own = (1, 2, 3, 4, 5, 6, 7)
    seq = PROMPT + [1]
    draft = _step(d, [("o", seq, 1, 0, _opts(own_draft=own))])[0]
    assert draft == [2, 3, 4, 5]
    seq = seq + [2, 8]              # 1 of the 4 scheduled (max_model_len cut), accepted, then 8
    _step(d, [("o", seq, 2, 1, _opts(own_draft=own))])
    stats = d.take_stats()
    assert stats["own_draft_tokens"] == 1 and stats["draft_tokens"] == 1 and stats["accepted_tokens"] == 1
    assert stats["proposed_tokens"] == 4


def test_without_verified_counts_stay_as_proposed():
    """SGLang verifies the whole draft in the step that proposes it: counted when proposed."""
    d = TreeDrafter(4, 256, {"min_prob": 0.0})
    _step(d, [("a", PROMPT + [1, 2, 3, 4, 5], 5, None, _opts())])
    draft = _step(d, [("b", PROMPT + [1], 1, None, _opts())])[0]
    stats = d.take_stats()
    assert draft == [2, 3, 4, 5] and stats["draft_tokens"] == 4 == stats["proposed_tokens"]


class Batch:
    """The runner's input batch as the patched propose_draft_token_ids hands it over, with the draft
    tokens the scheduler scheduled for each row this step (`spec_token_ids`)."""

    def __init__(self):
        self.token_ids_cpu = np.zeros((4, 64), dtype=np.int64)
        self.num_tokens_no_spec = np.zeros(4, dtype=np.int64)
        self.spec_token_ids = [[] for _ in range(4)]
        self.req_ids, self.requests = [], {}

    def add(self, req_id, prompt):
        i = len(self.req_ids)
        self.req_ids.append(req_id)
        self.token_ids_cpu[i, :len(prompt)] = prompt
        self.num_tokens_no_spec[i] = len(prompt)
        params = SimpleNamespace(extra_args={tp.DRAFT_KEY: "q", tp.RESPONSE_START: len(prompt)})
        self.requests[req_id] = SimpleNamespace(prompt_token_ids=list(prompt), sampling_params=params)

    def sample(self, i, tokens):
        n = self.num_tokens_no_spec[i]
        self.token_ids_cpu[i, n:n + len(tokens)] = tokens
        self.num_tokens_no_spec[i] = n + len(tokens)
        return list(tokens)


def test_proposer_reads_the_scheduled_drafts_from_the_input_batch(monkeypatch):
    monkeypatch.setenv(tp.SETTINGS_ENV, tp.settings_env(min_prob=0.0))
    p = tp.TreeProposer(SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=4),
                                        model_config=SimpleNamespace(max_model_len=64)))
    b = Batch()
    b.add("a", PROMPT)
    b.add("b", PROMPT)
    first = p.propose_batch(b, b.requests, [b.sample(0, [1, 2, 3, 4, 5]), b.sample(1, [1])])
    assert first[1] == [2, 3, 4, 5]
    # next step: the scheduler scheduled 3 of b's 4 draft tokens, the grammar padded the last with -1
    b.spec_token_ids[0], b.spec_token_ids[1] = list(first[0]), [2, 3, -1]
    p.propose_batch(b, b.requests, [b.sample(0, [6]), b.sample(1, [2, 3, 9])])
    stats = p.take_stats()
    assert stats["draft_tokens"] == 2 + len(first[0]) and stats["accepted_tokens"] == 2
    assert tp.verified_count([7, 8, -1, -1]) == 2 and tp.verified_count([]) == 0
