"""Per-prompt draft trees (rollout/tree_drafting/trees.py): counts, matching, proposals, in-flight siblings,
eviction, persistence. Expectations are computed by hand in the comments, plus one randomized
cross-check against a brute-force reference of the documented trie semantics. Every test runs on
both implementations: the Python automata and the compiled ones (rollout/tree_drafting/compiled_trees.py).
"""

import json
import random
import tracemalloc
import numpy as np
import pytest
from megatron_specrl.rollout.tree_drafting import compiled_trees
from megatron_specrl.rollout.tree_drafting.trees import DraftTrees



# ---- Per-prompt draft trees (rollout/tree_drafting/trees.py): counts, matching, proposals, in-flight siblings,

@pytest.fixture(autouse=True, params=["python", "compiled"])
def impl(request, monkeypatch):
    """Runs the module's tests on DraftTrees and on CompiledDraftTrees (the name DraftTrees is rebound)."""
    if request.param == "compiled":
        monkeypatch.setitem(globals(), "DraftTrees", compiled_trees.CompiledDraftTrees)
    return request.param


def started(trees, rid, key, tokens):
    trees.start(rid, key, tokens)
    return rid


# -- constructor --------------------------------------------------------------

@pytest.mark.parametrize("kwargs, name", [
    ({"max_depth": 16, "max_match": 16}, "max_depth"),     # no room to continue a full-length match
    ({"max_depth": 8, "max_match": 12}, "max_depth"),
    ({"max_match": 0}, "max_match"),
    ({"max_match": True}, "max_match"),
    ({"max_depth": "32"}, "max_depth"),
    ({"max_nodes": 0}, "max_nodes"),
    ({"max_nodes": 10.5}, "max_nodes"),
])
def test_constructor_rejects_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DraftTrees(**kwargs)


def test_constructor_accepts_defaults():
    t = DraftTrees()
    assert (t.max_depth, t.max_match, t.max_nodes) == (32, 16, 2_000_000)


# -- counts -------------------------------------------------------------------

def test_insert_counts_every_occurrence():
    t = DraftTrees(max_depth=4, max_match=2)
    t.insert("k", [1, 2, 3, 1, 2, 4])
    assert [t.count("k", s) for s in ([1], [2], [1, 2], [2, 3], [1, 2, 4], [3, 1, 2])] == [2, 2, 2, 1, 1, 1]
    assert t.count("k", [5]) == 0 and t.count("k", [2, 1]) == 0 and t.count("other", [1]) == 0
    assert t.children("k", [1, 2]) == {3: 1, 4: 1}
    assert t.children("k", []) == {1: 2, 2: 2, 3: 1, 4: 1}
    t.insert("k", [1, 2, 3])
    assert t.count("k", [1, 2]) == 3 and t.count("k", [1, 2, 3]) == 2
    assert t.children("k", [1, 2]) == {3: 2, 4: 1}
    # depth bound: a node of depth 4 exists, depth 5 does not, and a depth-4 node has no children
    assert t.count("k", [1, 2, 3, 1]) == 1
    assert t.count("k", [1, 2, 3, 1, 2]) == 0
    assert t.children("k", [1, 2, 3, 1]) == {}


def test_counts_of_overlapping_repeats():
    t = DraftTrees(max_depth=4, max_match=2)
    t.insert("r", [7, 7, 7])
    assert [t.count("r", [7] * n) for n in (1, 2, 3, 4)] == [3, 2, 1, 0]
    t.insert("r", [7, 7])
    assert [t.count("r", [7] * n) for n in (1, 2, 3)] == [5, 3, 1]
    st = t.stats()
    assert (st["keys"], st["tokens"], st["sequences"]) == (1, 5, 2)


# -- matching -----------------------------------------------------------------

def _two_families(max_match):
    t = DraftTrees(max_depth=32, max_match=max_match)
    t.insert("k", [0, 1, 2, 3])
    for _ in range(3):
        t.insert("k", [9, 2, 4])
    return t


def test_longest_match_wins_and_max_match_is_respected():
    # context [0, 1, 2]: its full suffix occurs once, followed by 3; the suffix [2] occurs 4 times,
    # 3 of them followed by 4. The longest match decides, not the counts.
    t = _two_families(16)
    assert t.propose(started(t, "r", "k", [0, 1, 2]), 8) == [3]
    t = _two_families(2)
    assert t.propose(started(t, "r", "k", [0, 1, 2]), 8) == [3]       # [1, 2] still picks family 1
    t = _two_families(1)
    assert t.propose(started(t, "r", "k", [0, 1, 2]), 8) == [4]       # only [2]: 4 at 3/4


def test_own_tail_is_not_a_match():
    t = DraftTrees()
    assert t.propose(started(t, "r", "new", [1, 2, 3]), 8) == []       # only occurrence: its own end
    t.insert("k", [8, 6])
    # [5, 7, 8] and [7, 8] occur only at the request's own end; [8] also occurs followed by 6
    assert t.propose(started(t, "s", "k", [5, 7, 8]), 8) == [6]
    # an earlier occurrence in the request's own sequence does count: "1" was followed by "2 1"
    assert t.propose(started(t, "u", "own", [1, 2, 1]), 8) == [2, 1]


def test_no_match_returns_empty():
    t = DraftTrees()
    t.insert("k", [1, 2, 3])
    assert t.propose(started(t, "r", "k", [42]), 8) == []
    assert t.propose(started(t, "s", "k", []), 8) == []
    assert t.propose(started(t, "u", "k", [1]), 0) == []


# -- proposals ----------------------------------------------------------------

def test_most_frequent_path_and_min_prob():
    t = DraftTrees()
    for s in ([1, 2, 3], [1, 2, 3], [1, 4]):
        t.insert("k", s)
    r = started(t, "r", "k", [1])
    # node [1]: children 2 (count 2), 4 (count 1) -> 2 at 2/3; node [1, 2]: 3 at 2/2; then nothing
    assert t.propose(r, 8, min_prob=0.5) == [2, 3]
    assert t.propose(r, 8, min_prob=0.0) == [2, 3]
    assert t.propose(r, 8, min_prob=0.7) == []


def test_ties_take_the_smallest_token():
    t = DraftTrees()
    t.insert("k", [1, 5])
    t.insert("k", [1, 3])
    r = started(t, "r", "k", [1])
    assert t.propose(r, 4, min_prob=0.5) == [3]          # 3 and 5 both once: smallest id
    t.insert("k", [1, 5])
    assert t.propose(r, 4, min_prob=0.5) == [5]          # now 5 twice: frequency first


def test_min_prob_stops_mid_walk():
    t = DraftTrees()
    for s in ([1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6]):
        t.insert("k", s)
    r = started(t, "r", "k", [1])
    # [1] -> 2 (3/3), [1 2] -> 3 (2/3: path 0.667), [1 2 3] -> 4 (1/2, tie with 5: path 0.333)
    assert t.propose(r, 8, min_prob=0.7) == [2]
    assert t.propose(r, 8, min_prob=0.5) == [2, 3]
    assert t.propose(r, 8, min_prob=0.3) == [2, 3, 4]


def test_max_tokens_and_depth_stop():
    t = DraftTrees(max_depth=4, max_match=2)
    t.insert("k", [1, 2, 3, 4, 5, 6, 7])
    r = started(t, "r", "k", [1])
    assert t.propose(r, 2) == [2, 3]                 # max_tokens
    assert t.propose(r, 10) == [2, 3, 4]             # match of length 1 + 3 tokens = depth 4
    s = started(t, "s", "k", [9, 1, 2])
    assert t.propose(s, 10) == [3, 4]                # match [1, 2] (max_match 2) + 2 tokens = depth 4
    deep = DraftTrees(max_depth=32, max_match=16)
    deep.insert("k", [1, 2, 3, 4, 5, 6, 7])
    assert deep.propose(started(deep, "r", "k", [1]), 10) == [2, 3, 4, 5, 6, 7]   # data ends


def test_numpy_tokens_are_accepted_and_proposals_are_ints():
    t = DraftTrees()
    t.insert("k", np.array([1, 2, 3], dtype=np.int64))
    out = t.propose(started(t, "r", "k", np.array([1], dtype=np.int32)), 4)
    assert out == [2, 3] and all(type(x) is int for x in out)


# -- in flight ----------------------------------------------------------------

def test_sibling_tokens_are_proposable_immediately_and_only_for_the_same_key():
    t = DraftTrees()
    t.start("a", "p")
    t.start("b", "p")
    t.start("c", "q")
    t.extend("a", [1, 2, 3, 4])
    t.extend("b", [1])
    assert t.propose("b", 8) == [2, 3, 4]
    t.extend("c", [1])
    assert t.propose("c", 8) == []                  # another key never sees them
    t.extend("a", [5])
    assert t.propose("b", 8) == [2, 3, 4, 5]
    t.extend("b", [2, 3, 4, 5])
    assert t.propose("b", 8) == []                  # [... 5] occurs only at the two in-flight ends
    t.extend("a", [6])
    assert t.propose("b", 8) == [6]
    assert t.count("p", [1, 2, 3, 4, 5]) == 2 and t.count("q", [1]) == 1


def test_finish_forgets_the_request_but_keeps_its_tokens():
    t = DraftTrees()
    t.start("a", "p", [1, 2, 3])
    with pytest.raises(ValueError, match="already started"):
        t.start("a", "p")
    t.finish("a")
    assert t.stats()["active_requests"] == 0 and t.stats()["sequences"] == 1
    with pytest.raises(KeyError):
        t.propose("a", 4)
    with pytest.raises(KeyError):
        t.extend("a", [4])
    assert t.propose(started(t, "b", "p", [1]), 4) == [2, 3]
    t.start("a", "p", [2])                          # the id can be reused after finish
    assert t.propose("a", 4) == [3]


# -- eviction -----------------------------------------------------------------

def _three_keys(max_nodes):
    """Keys a, b, c (in that LRU order), 10 distinct tokens each: 10 automaton states each."""
    t = DraftTrees(max_depth=8, max_match=4, max_nodes=max_nodes)
    for i, key in enumerate("abc"):
        t.insert(key, list(range(10 * i, 10 * i + 10)))
    assert t.stats()["nodes"] == 30
    return t


def test_eviction_takes_the_least_recently_used_key():
    t = _three_keys(35)
    t.start("x", "a")
    t.finish("x")                                   # start = use: order b, c, a
    t.insert("d", list(range(30, 40)))              # needs 10 states, 5 free: one key goes
    assert [t.has_key(k) for k in "abcd"] == [True, False, True, True]
    assert t.stats()["nodes"] == 30 and t.stats()["evicted_keys"] == 1
    assert t.count("d", list(range(30, 38))) == 1 and t.count("d", [39]) == 1   # inserted in full


def test_propose_counts_as_use():
    t = _three_keys(35)
    t.start("r", "a")
    t.start("s", "b")
    t.start("u", "c")                               # order a, b, c
    t.finish("s")
    t.finish("u")
    t.propose("r", 4)                               # order b, c, a
    t.finish("r")
    t.insert("d", list(range(30, 40)))
    assert [t.has_key(k) for k in "abcd"] == [True, False, True, True]


def test_active_key_is_never_evicted():
    t = _three_keys(35)
    t.start("r", "a")
    t.start("s", "b")
    t.start("u", "c")                               # order a, b, c; a stays active
    t.finish("s")
    t.finish("u")
    t.insert("d", list(range(30, 40)))
    assert [t.has_key(k) for k in "abcd"] == [True, False, True, True]
    assert t.propose("r", 4) == []                  # and the request goes on


def test_no_room_stops_insertion_without_raising():
    t = DraftTrees(max_depth=8, max_match=4, max_nodes=25)
    t.insert("a", list(range(10)))
    t.insert("b", list(range(10, 20)))              # 20 states
    t.start("r", "a")
    t.start("s", "b")
    t.insert("d", list(range(30, 40)))              # 5 free, a and b active: 4 tokens fit (2 spare each)
    assert t.stats()["nodes"] == 24 and t.has_key("a") and t.has_key("b")
    assert t.count("d", [30, 31, 32, 33]) == 1 and t.count("d", [34]) == 0
    t.finish("r")
    t.insert("d", list(range(34, 40)))              # now a can go
    assert not t.has_key("a") and t.count("d", [39]) == 1 and t.stats()["nodes"] == 20


def test_full_tree_request_keeps_drafting_from_what_is_stored():
    t = DraftTrees(max_depth=8, max_match=4, max_nodes=6)
    t.insert("a", [1, 2, 3, 4, 5])                  # 5 states
    r = started(t, "r", "a", [])
    t.extend(r, [1])                                # no room for 2 more states, nothing to evict
    assert t.stats()["frozen_requests"] == 1 and t.stats()["nodes"] == 5
    assert t.count("a", [1]) == 1                   # not inserted
    assert t.propose(r, 8) == [2, 3, 4, 5]          # its context still drives the match
    t.extend(r, [2, 7, 1, 2])
    assert t.propose(r, 8) == [3, 4, 5]
    t.extend(r, [9])
    assert t.propose(r, 8) == []


def test_many_inserts_stay_within_max_nodes():
    rng = random.Random(0)
    t = DraftTrees(max_depth=8, max_match=4, max_nodes=300)
    for i in range(200):
        t.insert(f"k{rng.randrange(40)}", [rng.randrange(6) for _ in range(rng.randrange(1, 30))])
        st = t.stats()
        assert st["nodes"] <= 300
        assert st["nodes"] == sum(tree.nodes for tree in t._trees.values())   # bookkeeping
    assert st["evicted_keys"] > 0


def test_memory_bytes_grows_with_tokens_and_is_honest():
    rng = random.Random(1)
    seqs = [[1000 + rng.randrange(40) for _ in range(96)] for _ in range(60)]   # ids beyond the small-int cache
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        t = DraftTrees()
        sizes = []
        for i, s in enumerate(seqs):
            t.insert(f"k{i % 6}", [int(str(x)) for x in s])
            if i % 20 == 19:
                sizes.append(t.stats()["memory_bytes"])
        traced = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert sizes[0] < sizes[1] < sizes[2]
    assert 0.85 < sizes[-1] / traced < 1.15, (sizes[-1], traced)   # measured 0.96


def test_sizes_count_the_sequences_without_walking_them(monkeypatch):
    """sizes() (what the engines report after every rollout) keeps the finished sequences' bytes per key
    as they finish: the same memory_bytes as a walk over every stored sequence, through in-flight
    requests, keep_newest, eviction and a restore."""
    from megatron_specrl.rollout.tree_drafting import trees as trees_module
    real = trees_module.sequences_bytes

    def walked(t):
        """(sizes(), the sizes from a walk over every stored sequence as before, sequences sizes() read)."""
        read = []
        monkeypatch.setattr(trees_module, "sequences_bytes", lambda seqs: read.extend(seqs) or real(seqs))
        try:
            got = t.sizes()
        finally:
            monkeypatch.setattr(trees_module, "sequences_bytes", real)
        monkeypatch.setattr(t, "_seqs_bytes", lambda trees: [real(tree.seqs) for tree in trees], raising=False)
        try:
            ref = t.sizes()
        finally:
            monkeypatch.delattr(t, "_seqs_bytes")
        return got, ref, len(read)

    rng = random.Random(3)
    t = DraftTrees(max_depth=10, max_match=4, max_nodes=1000)
    live = []
    for i in range(400):
        op = rng.random()
        if op < 0.3:
            t.insert(f"k{rng.randrange(12)}", [1000 + rng.randrange(30) for _ in range(rng.randrange(0, 40))])
        elif op < 0.55 or not live:
            rid = f"r{i}"
            t.start(rid, "shared" if rng.random() < 0.3 else f"k{rng.randrange(12)}", [1000 + rng.randrange(30)])
            live.append(rid)
        elif op < 0.85:
            t.extend(rng.choice(live), [1000 + rng.randrange(30) for _ in range(rng.randrange(1, 6))])
        else:
            t.finish(live.pop(rng.randrange(len(live))))
        if i % 50 == 25:
            t.keep_newest("shared", 200)
        if i % 20 == 0:
            got, ref, walked_seqs = walked(t)
            assert got == ref, i
            assert walked_seqs == len(t._reqs)               # only the sequences still growing
    assert t.stats()["evicted_keys"] > 0
    restored = type(t).from_state_dict(t.state_dict())
    got, ref, walked_seqs = walked(restored)
    assert got == ref and walked_seqs == 0


# -- persistence --------------------------------------------------------------

def _populated():
    t = DraftTrees(max_depth=12, max_match=4, max_nodes=10_000)
    for s in ([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 5], [3, 4, 3, 4, 6]):
        t.insert("p", s)
    t.insert("q", [7, 8, 9])
    t.start("live", "p", [1, 2, 3, 9, 9])           # in flight: saved as a finished sequence
    t.start("other", "q", [7])
    return t


CONTEXTS = [("p", [1]), ("p", [1, 2, 3]), ("p", [3, 9]), ("p", [4, 3]), ("q", [7]), ("q", [8, 9]), ("p", [0])]


def _proposals(t):
    out = []
    for n, (key, ctx) in enumerate(CONTEXTS):
        out.append(t.propose(started(t, ("probe", n), key, ctx), 8, 0.1))
        t.finish(("probe", n))
    return out


def test_state_dict_round_trip_drafts_the_same():
    t = _populated()
    state = t.state_dict()
    json.dumps({k: v for k, v in state.items() if not isinstance(v, np.ndarray)})   # the rest is json-able
    restored = DraftTrees.from_state_dict(state)
    expected = _proposals(t)
    # hand check of two: [1] -> 2 (4/4 incl. live) -> 3 (3/4 incl. live) -> 4 (2/3: 0.5 overall)
    assert expected[0] == [2, 3, 4] and expected[2] == [9]
    assert _proposals(restored) == expected
    assert restored.keys() == t.keys()
    for k in ("keys", "tokens", "sequences", "nodes"):
        assert restored.stats()[k] == t.stats()[k]


def test_state_dict_rebuilt_under_the_loading_sides_bounds():
    """A resumed run may have changed its bounds: the trees follow the loader's, not the checkpoint's.
    A smaller max_nodes drops the least recently used keys while rebuilding; the rest draft as trees
    built fresh under the new bounds from the same sequences."""
    old = DraftTrees(max_depth=12, max_match=4, max_nodes=10_000)
    for key in ("a", "b", "c"):                       # LRU order a (oldest), b, c
        old.insert(key, [ord(key)] + list(range(20)))
    old.insert("a", [ord("a")] + list(range(5)))      # inserting is not a use: a stays the oldest
    state = old.state_dict()
    per_key = old.nodes_of("b")
    small = DraftTrees.from_state_dict(state, max_depth=10, max_match=3, max_nodes=2 * per_key + 5)
    assert (small.max_depth, small.max_match, small.max_nodes) == (10, 3, 2 * per_key + 5)
    assert small.keys() == ["b", "c"] and small.stats()["evicted_keys"] == 1
    fresh = DraftTrees(max_depth=10, max_match=3, max_nodes=2 * per_key + 5)
    for key in ("b", "c"):
        fresh.insert(key, [ord(key)] + list(range(20)))
    for key in ("b", "c"):
        for ctx in ([ord(key)], [3, 4], [17, 18, 19]):
            a, b = started(small, ("s", key, *ctx), key, ctx), started(fresh, ("f", key, *ctx), key, ctx)
            assert small.propose(a, 12, 0.0) == fresh.propose(b, 12, 0.0)
    # a 1-token match continued to depth 10: 9 tokens (the checkpoint's depth 12 would give 11)
    assert small.propose(started(small, "x", "b", [ord("b")]), 12, 0.0) == list(range(9))
    with pytest.raises(TypeError, match="max_children"):
        DraftTrees.from_state_dict(state, max_children=3)


def test_save_load_round_trip(tmp_path):
    t = _populated()
    t.save(tmp_path / "dt")
    restored = DraftTrees.load(tmp_path / "dt")
    assert (restored.max_depth, restored.max_match, restored.max_nodes) == (12, 4, 10_000)
    assert _proposals(restored) == _proposals(t)


def test_load_reports_missing_and_corrupt_files(tmp_path):
    with pytest.raises(RuntimeError, match="nowhere.*missing or corrupt"):
        DraftTrees.load(tmp_path / "nowhere")
    d = tmp_path / "dt"
    _populated().save(d)
    (d / "draft_trees.npz").write_bytes(b"not a zip")
    with pytest.raises(RuntimeError, match=str(d.name)):
        DraftTrees.load(d)
    _populated().save(d)
    meta = json.loads((d / "draft_trees.json").read_text())
    meta["keys"] = meta["keys"][:1]
    (d / "draft_trees.json").write_text(json.dumps(meta))
    with pytest.raises(RuntimeError, match="disagree"):
        DraftTrees.load(d)


# -- brute-force cross-check --------------------------------------------------

def reference_propose(seqs, ctx, max_tokens, min_prob, max_match, max_depth):
    """The documented semantics, computed from the raw sequences."""
    for L in range(min(max_match, len(ctx)), 0, -1):
        occ = [(s, p) for s in seqs for p in range(L - 1, len(s) - 1) if s[p - L + 1:p + 1] == ctx[-L:]]
        if occ:
            break
    else:
        return []
    out, prob = [], 1.0
    while len(out) < min(max_tokens, max_depth - L):
        nxt = {}
        for s, p in occ:
            if p + 1 < len(s):
                nxt.setdefault(s[p + 1], []).append((s, p + 1))
        if not nxt:
            break
        c = min(nxt, key=lambda c: (-len(nxt[c]), c))
        prob *= len(nxt[c]) / sum(map(len, nxt.values()))
        if prob < min_prob:
            break
        out.append(c)
        occ = nxt[c]
    return out


def test_matches_brute_force_reference_with_interleaved_requests():
    rng = random.Random(7)
    for trial in range(60):
        vocab = rng.choice([2, 3, 5])
        max_match = rng.randint(1, 5)
        max_depth = max_match + rng.randint(1, 6)
        t = DraftTrees(max_depth=max_depth, max_match=max_match)
        seqs, live = {"k0": [], "k1": []}, {}
        for _ in range(rng.randint(0, 4)):
            key, s = rng.choice(["k0", "k1"]), [rng.randrange(vocab) for _ in range(rng.randint(0, 12))]
            t.insert(key, s)
            seqs[key].append(s)
        for step in range(40):
            op = rng.random()
            if op < 0.15 or not live:
                rid, key = (trial, step), rng.choice(["k0", "k1"])
                s = [rng.randrange(vocab) for _ in range(rng.randint(0, 3))]
                t.start(rid, key, s)
                seqs[key].append(s)       # the same list object grows with the request below
                live[rid] = (key, s)
            elif op < 0.25:
                rid = rng.choice(list(live))
                t.finish(rid)
                del live[rid]
            else:
                rid = rng.choice(list(live))
                toks = [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
                t.extend(rid, toks)
                live[rid][1].extend(toks)
            for rid, (key, s) in live.items():
                mt, mp = rng.randint(0, 8), rng.choice([0.0, 0.2, 0.5])
                assert t.propose(rid, mt, mp) == reference_propose(seqs[key], s, mt, mp, max_match, max_depth)


def test_counts_match_brute_force_in_repetitive_interleaved_sequences():
    # long repeats of 1-3 tokens, several sequences growing in turn, sequences far longer than
    # max_depth: every substring count up to max_depth + 1 checked against the raw sequences
    rng = random.Random(3)
    for trial in range(40):
        vocab, max_depth = rng.choice([1, 2, 3]), rng.randint(2, 6)
        t = DraftTrees(max_depth=max_depth, max_match=max_depth - 1)
        seqs = [[] for _ in range(rng.randint(1, 3))]
        for i in range(len(seqs)):
            t.start(i, "k")
        for _ in range(rng.randint(1, 40)):
            i = rng.randrange(len(seqs))
            toks = [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
            t.extend(i, toks)
            seqs[i].extend(toks)
        subs = {tuple(s[p:p + n]) for s in seqs for n in range(1, max_depth + 2) for p in range(len(s) - n + 1)}
        for sub in subs:
            n = len(sub)
            expected = sum(s[p:p + n] == list(sub) for s in seqs for p in range(len(s) - n + 1))
            assert t.count("k", sub) == (expected if n <= max_depth else 0), (trial, sub)


def reference_scored(seqs, ctx, max_tokens, min_prob, max_match, max_depth):
    """reference_propose's draft and the sum of the path probability up to each of its tokens."""
    draft = reference_propose(seqs, ctx, max_tokens, min_prob, max_match, max_depth)
    if not draft:
        return [], 0.0
    for L in range(min(max_match, len(ctx)), 0, -1):
        occ = [(s, p) for s in seqs for p in range(L - 1, len(s) - 1) if s[p - L + 1:p + 1] == ctx[-L:]]
        if occ:
            break
    prob, score = 1.0, 0.0
    for c in draft:
        nxt = [(s, p + 1) for s, p in occ if p + 1 < len(s)]
        hit = [(s, p) for s, p in nxt if s[p] == c]
        prob *= len(hit) / len(nxt)
        score += prob
        occ = hit
    return draft, score


def test_scored_proposal_is_the_expected_accepted_length():
    rng = random.Random(11)
    for trial in range(200):
        vocab = rng.choice([2, 3, 4])
        t = DraftTrees(max_depth=12, max_match=4)
        seqs = [[rng.randrange(vocab) for _ in range(rng.randint(0, 10))] for _ in range(rng.randint(1, 5))]
        for s in seqs:
            t.insert("k", s)
        ctx = [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
        t.start(trial, "k", ctx)
        mt, mp = rng.randint(0, 6), rng.choice([0.0, 0.3])
        draft, score = t.propose_scored(trial, mt, mp)
        want, want_score = reference_scored(seqs + [ctx], ctx, mt, mp, 4, 12)
        assert draft == want == t.propose(trial, mt, mp)
        assert score == pytest.approx(want_score)
        assert (score > 0) == bool(draft) and score <= len(draft) + 1e-12


def test_keep_newest_rebuilds_from_the_newest_sequences_and_live_requests_go_on():
    """A bounded shared tree: after keep_newest the key answers as if only the newest finished
    sequences (2 states a token within the bound) and the live ones had been inserted, and the live
    requests keep extending and drafting; checked against the brute-force reference throughout."""
    rng = random.Random(5)
    for trial in range(40):
        vocab, max_match, max_depth = rng.choice([2, 3]), 3, 8
        t = DraftTrees(max_depth=max_depth, max_match=max_match)
        t.insert("other", [1, 2, 1, 2])
        seqs, live = [], {}
        for step in range(60):
            op = rng.random()
            if op < 0.2 or not live:
                rid = (trial, step)
                s = [rng.randrange(vocab) for _ in range(rng.randint(0, 3))]
                t.start(rid, "k", s)
                seqs.append(s)
                live[rid] = s
            elif op < 0.35:
                t.finish(rid := rng.choice(list(live)))
                del live[rid]
            elif op < 0.45:
                bound = rng.randint(0, 60)
                ids = {id(s) for s in live.values()}
                room = bound - sum(2 * len(s) for s in live.values())
                finished, kept = [s for s in seqs if id(s) not in ids], []
                for s in reversed(finished):
                    if 2 * len(s) > room:
                        break
                    room -= 2 * len(s)
                    kept.append(s)
                assert t.keep_newest("k", bound) == len(finished) - len(kept)
                seqs = kept[::-1] + [s for s in seqs if id(s) in ids]
            else:
                rid = rng.choice(list(live))
                toks = [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
                t.extend(rid, toks)
                live[rid].extend(toks)
            for rid, s in live.items():
                mt = rng.randint(0, 5)
                assert t.propose(rid, mt, 0.0) == reference_propose(seqs, s, mt, 0.0, max_match, max_depth)
            assert t.stats()["nodes"] == t.nodes_of("k") + t.nodes_of("other")
    assert t.keep_newest("absent", 10) == 0 and t.count("other", [1, 2]) == 2


def test_depth_beyond_match_plus_draft_length_changes_no_proposal():
    """The engines keep counts only to max_match + the longest draft (TreeDrafter's default max_depth):
    a proposal reads no deeper, so a deeper automaton proposes exactly the same drafts and scores."""
    rng = random.Random(11)
    for trial in range(30):
        vocab, max_match, k = rng.choice([2, 3, 4]), rng.randint(1, 6), rng.randint(1, 8)
        shallow = DraftTrees(max_depth=max_match + k, max_match=max_match)
        deep = DraftTrees(max_depth=max_match + k + rng.randint(1, 12), max_match=max_match)
        live = []
        for step in range(60):
            if rng.random() < 0.2 or not live:
                rid = (trial, step)
                prefix = [rng.randrange(vocab) for _ in range(rng.randint(0, 3))]
                for t in (shallow, deep):
                    t.start(rid, "key", prefix)
                live.append(rid)
            rid = rng.choice(live)
            toks = [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
            for t in (shallow, deep):
                t.extend(rid, toks)
            for rid in live:
                mt, mp = rng.randint(0, k), rng.choice([0.0, 0.1, 0.4])
                assert shallow.propose_scored(rid, mt, mp) == deep.propose_scored(rid, mt, mp)
