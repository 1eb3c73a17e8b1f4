"""The tree drafter's counters count what the engine verified.

vLLM verifies a draft in the step after the one that proposed it, and its scheduler may verify fewer
   of its tokens (cut to the step's token budget or max_model_len) or none (a preempted request):
   draft_tokens (accept_rate's denominator) and the own / shared draft counters count the verified
   tokens (`TreeDrafter.request(..., verified=)`; the proposer reads them from the runner's
   `InputBatch.spec_token_ids`), proposed_tokens everything proposed.
Engine-free: the drafter and the proposer with a fake input batch, as tests/test_tree_proposer.py.
"""

from test_tree_proposer import Batch as ProposerBatch, _proposer

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


class Batch(ProposerBatch):
    """test_tree_proposer's runner view, with the draft tokens the scheduler scheduled for each row this
    step (`spec_token_ids`)."""

    def __init__(self):
        super().__init__()
        self.spec_token_ids = [[] for _ in range(4)]

    def add(self, req_id, prompt):
        super().add(req_id, prompt, "q")


def test_proposer_reads_the_scheduled_drafts_from_the_input_batch(monkeypatch):
    p = _proposer(monkeypatch, k=4, max_model_len=64, min_prob=0.0)
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
