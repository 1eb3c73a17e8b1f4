"""The drafter's calibration of tree frequencies (rollout/tree_drafting/drafter.Calibration): the trees' walk

The tests of this subject that start processes or engines; the rest are in tests/unit/engines/test_tree_drafter.py.
"""

from __future__ import annotations
from megatron_specrl.rollout.tree_drafting.drafter import (
    SHARED_KEY,
)
from tests.helpers.trees import sequences  # noqa: F401


from tests.helpers.proposer import Batch, EOS, _proposer  # noqa: F401

def test_drafts_stop_at_the_requests_remaining_max_tokens(monkeypatch):
    """A request that may generate r more tokens gains at most r from a step: the step's bonus token
    plus r - 1 draft tokens. vLLM's scheduler verifies whatever it is given."""
    p = _proposer(monkeypatch, k=8, min_prob=0.0)
    p.trees.insert("q", list(range(10, 40)))
    b = Batch()
    b.add("a", [50, 51], "q", max_tokens=5)
    assert p.propose_batch(b, b.requests, [b.sample(0, [10])]) == [[11, 12, 13]]   # 4 more tokens: 3 + bonus
    assert p.propose_batch(b, b.requests, [b.sample(0, [11, 12])]) == [[13]]        # 2 more: 1 + bonus


def test_tokens_past_a_stop_or_max_tokens_enter_no_tree_and_no_counter(monkeypatch):
    """The runner hands over all of a step's sampled tokens; the scheduler keeps them up to the first
    stop token (EOS or stop_token_ids) or up to max_tokens, and the request ends there."""
    p = _proposer(monkeypatch, k=8, min_prob=0.0)
    b = Batch()
    b.add("eos", [50], "q", max_tokens=20)
    b.add("stop", [50], "q", max_tokens=20, stop_token_ids=[7])
    b.add("len", [50], "q", max_tokens=3)
    p.propose_batch(b, b.requests, [b.sample(0, [4]), b.sample(1, [4]), b.sample(2, [4])])
    # a step accepting drafts through the end: [5, EOS] and [5, 7] and [5, 6] are kept
    p.propose_batch(b, b.requests, [b.sample(0, [5, EOS, 8, 9]), b.sample(1, [5, 7, 8, 9]),
                                    b.sample(2, [5, 6, 8, 9])])
    for tree in ("q", SHARED_KEY):
        assert p.trees.count(tree, [4, 5]) == 3
        assert p.trees.count(tree, [8]) == 0 and p.trees.count(tree, [9]) == 0, tree
    stats = p.take_stats()
    assert stats["generated_tokens"] == 3 * 3, stats


def test_drafts_end_at_a_stop_token(monkeypatch):
    """Draft tokens after a stop token are verified for nothing: the request ends at the stop token."""
    p = _proposer(monkeypatch, k=8, min_prob=0.0)
    p.trees.insert("q", [10, 11, EOS])
    p.trees.insert(SHARED_KEY, [10, 11, EOS, 30, 31, 32])   # another prompt's tree went on past EOS
    b = Batch()
    b.add("a", [50], "q", max_tokens=20)
    assert p.propose_batch(b, b.requests, [b.sample(0, [10])]) == [[11, EOS]]


