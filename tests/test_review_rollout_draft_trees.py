"""Review tests for the draft trees: the compiled automata against the Python ones on inputs the
other tests leave out (token ids at the int32 edges, negative ids, long repetitions, tight bounds,
save/restore mid-run), and the stored sequences against the automata they were built into."""

import random

import pytest

from megatron_specrl.rollout.draft_tree import DraftTrees
from megatron_specrl.rollout.draft_tree_compiled import CompiledDraftTrees


class SmallCompiled(CompiledDraftTrees):
    initial_states = 8
    compact_min_garbage = 16


def _same(a, b, keys, probes):
    sa, sb = a.stats(), b.stats()
    for f in ("keys", "nodes", "tokens", "sequences", "active_requests", "frozen_requests", "evicted_keys"):
        assert sa[f] == sb[f], f
    assert a.keys() == b.keys()
    assert sa["nodes"] == sum(a.nodes_of(k) for k in a.keys()) <= a.max_nodes
    for key in keys:
        for probe in probes:
            assert a.count(key, probe) == b.count(key, probe)
            assert a.children(key, probe) == b.children(key, probe)


def _drive(seed, lo, vocab, steps=150):
    """Random starts, extends (some in repetition loops), inserts (some empty), finishes, keep_newest
    and state_dict round trips under random bounds; every proposal and size compared."""
    rng = random.Random(seed)
    depth = rng.randrange(3, 12)
    match = rng.randrange(1, depth)
    nodes = rng.choice((50, 200, 10**7))
    a, b = DraftTrees(depth, match, nodes), SmallCompiled(depth, match, nodes)
    tok = lambda: lo + rng.randrange(vocab)   # noqa: E731
    keys = [f"k{i}" for i in range(rng.randrange(1, 5))]
    live, n = [], 0
    for _ in range(steps):
        op = rng.random()
        if op < 0.1 or not live:
            rid, n = f"r{n}", n + 1
            pre = [tok() for _ in range(rng.choice((0, 1, 5, 30)))]
            key = rng.choice(keys)
            for t in (a, b):
                t.start(rid, key, pre)
            live.append(rid)
        elif op < 0.15:
            rid = live.pop(rng.randrange(len(live)))
            for t in (a, b):
                t.finish(rid)
        elif op < 0.2:
            seq = [lo] * rng.randrange(40) if rng.random() < 0.3 else [tok() for _ in range(rng.choice((0, 1, 60)))]
            key = rng.choice(keys)
            for t in (a, b):
                t.insert(key, seq)
        elif op < 0.23:
            key, bound = rng.choice(keys), rng.randrange(300)
            assert a.keep_newest(key, bound) == b.keep_newest(key, bound)
        elif op < 0.25:
            bound = rng.choice((None, 100))
            a = DraftTrees.from_state_dict(a.state_dict(), max_nodes=bound)
            b = SmallCompiled.from_state_dict(b.state_dict(), max_nodes=bound)
            live = []
            continue
        else:
            rid = rng.choice(live)
            toks = [tok() for _ in range(rng.choice((0, 1, 2, 20)))]
            if toks and rng.random() < 0.3:
                toks = [toks[0]] * len(toks)
            ids = [rid] + ([rng.choice([r for r in live if r != rid])] if len(live) > 1 and rng.random() < 0.5 else [])
            k, mp = rng.randrange(depth + 3), rng.choice((0.0, 0.1, 0.5, 1.0))
            assert a.extend_and_propose(ids, toks, k, mp) == b.extend_and_propose(ids, toks, k, mp)
            for r in ids:
                assert a.propose_scored(r, k, mp) == b.propose_scored(r, k, mp)
        _same(a, b, keys, [[tok() for _ in range(rng.randrange(4))] for _ in range(3)])
        # what state_dict saves is what the automaton holds: rebuilt, every count and child agrees
        rebuilt = DraftTrees.from_state_dict(a.state_dict(), max_nodes=10**9)
        for key in keys:
            probe = [tok() for _ in range(rng.randrange(4))]
            assert a.count(key, probe) == rebuilt.count(key, probe)
            assert a.children(key, probe) == rebuilt.children(key, probe)


@pytest.mark.parametrize("lo, vocab", [(0, 3), (151_930, 6), (2**31 - 8, 8)])
def test_compiled_equals_python_at_vocab_edges_with_eviction_and_restore(lo, vocab):
    for seed in range(6):
        _drive(seed, lo, vocab)


def test_compiled_equals_python_for_negative_token_ids():
    """The Python trees take any int; the compiled ones keep (state, token) in one int64 hash key,
    where a negative token's sign bits overwrote the state (every state's transition on -1 read as
    the empty slot): they built other automata and drafted differently."""
    for seed in range(4):
        _drive(seed, -3, 5, steps=80)
