"""The compiled draft trees (rollout/tree_drafting/compiled_trees.py) against the Python ones: driven by the same
random operations, they must give the same proposals, scores, counts and sizes, also while their
arrays grow, keys are evicted, frozen requests match from scratch, keep_newest rebuilds a key and
the pool is compacted. tests/unit/rollout/test_draft_tree.py runs every hand-checked test on both as well.

Also the compiled automata against the Python ones on inputs the other tests leave out (token ids at
the int32 edges, negative ids, long repetitions, tight bounds, save/restore mid-run), and the stored
sequences against the automata they were built into.
"""

import random
import pytest
from megatron_specrl.rollout.tree_drafting.trees import DraftTrees
import sys
from megatron_specrl.rollout.tree_drafting.drafter import SHARED_KEY, RequestOpts, TreeDrafter, settings_env
from megatron_specrl.rollout.tree_drafting.compiled_trees import CompiledDraftTrees



# ---- The compiled draft trees (rollout/tree_drafting/compiled_trees.py) against the Python ones: driven by the same

class SmallCompiled(CompiledDraftTrees):
    """Tiny first arrays and an eager compaction, so that growth and compaction happen in a short test."""
    initial_states = 8
    compact_min_garbage = 16


def mutated(rng, base, vocab):
    out = list(base)
    for _ in range(rng.randrange(4)):
        i = rng.randrange(len(out) + 1)
        out[i:i + rng.randrange(3)] = [rng.randrange(vocab) for _ in range(rng.randrange(3))]
    return out


def drive(trees_a, trees_b, seed, steps=600, vocab=7, keys=6, max_live=1000, rebuild=True):
    """The same random operations on both; every read compared. Returns the operations' counts."""
    rng = random.Random(seed)
    bases = {f"p{i}": [rng.randrange(vocab) for _ in range(rng.randrange(5, 30))] for i in range(keys)}
    live: dict[str, tuple[str, list[int]]] = {}
    seen = dict.fromkeys(("propose", "pair", "insert", "keep_newest", "finish", "frozen"), 0)
    n = 0
    for _ in range(steps):
        op = rng.random()
        if (op < 0.12 or not live) and len(live) < max_live:
            key = rng.choice(list(bases))
            rid = f"r{n}"
            n += 1
            prefix = [rng.randrange(vocab) for _ in range(rng.randrange(3))]
            for t in (trees_a, trees_b):
                t.start(rid, key, prefix)
                t.start((rid, SHARED_KEY), SHARED_KEY, prefix)
            live[rid] = (key, mutated(rng, bases[key], vocab))
        elif op < 0.2 or len(live) >= max_live:
            rid = rng.choice(list(live))
            for t in (trees_a, trees_b):
                t.finish(rid)
                t.finish((rid, SHARED_KEY))
            del live[rid]
            seen["finish"] += 1
        elif op < 0.25:
            key = rng.choice(list(bases))
            seq = mutated(rng, bases[key], vocab)
            trees_a.insert(key, seq)
            trees_b.insert(key, seq)
            seen["insert"] += 1
        elif op < 0.28 and rebuild:
            bound = rng.randrange(10, 200)
            assert trees_a.keep_newest(SHARED_KEY, bound) == trees_b.keep_newest(SHARED_KEY, bound)
            seen["keep_newest"] += 1
        else:
            rid = rng.choice(list(live))
            key, target = live[rid]
            toks = [rng.choice((target[rng.randrange(len(target))], rng.randrange(vocab)))
                    for _ in range(rng.choice((0, 1, 1, 2, 3)))]
            k, min_prob = rng.randrange(1, 12), rng.choice((0.0, 0.1, 0.3))
            if rng.random() < 0.7:
                ids = (rid, (rid, SHARED_KEY)) if rng.random() < 0.8 else (rng.choice((rid, (rid, SHARED_KEY))),)
                got = [t.extend_and_propose(ids, toks, k, min_prob) for t in (trees_a, trees_b)]
                seen["pair"] += 1
            else:
                got = []
                for t in (trees_a, trees_b):
                    if toks:
                        t.extend(rid, toks)
                        t.extend((rid, SHARED_KEY), toks)
                    got.append((t.propose_scored(rid, k, min_prob), t.propose_scored((rid, SHARED_KEY), k, min_prob)))
                seen["propose"] += 1
            assert got[0] == got[1]
        sa, sb = trees_a.stats(), trees_b.stats()
        for field in ("keys", "nodes", "tokens", "sequences", "active_requests", "frozen_requests", "evicted_keys"):
            assert sa[field] == sb[field], field
        assert trees_a.keys() == trees_b.keys()
        seen["frozen"] = max(seen["frozen"], sa["frozen_requests"])
        key = rng.choice(list(bases))
        probe = mutated(rng, bases[key], vocab)[:rng.randrange(0, 5)]
        assert trees_a.count(key, probe) == trees_b.count(key, probe)
        assert trees_a.children(key, probe) == trees_b.children(key, probe)
    return seen


@pytest.mark.parametrize("seed", range(4))
def test_same_drafts_as_python_with_growth_and_compaction(seed):
    a = DraftTrees(max_depth=12, max_match=5, max_nodes=10_000_000)
    b = SmallCompiled(max_depth=12, max_match=5, max_nodes=10_000_000)
    seen = drive(a, b, seed)
    assert seen["pair"] > 100 and seen["keep_newest"] > 5 and seen["insert"] > 10
    assert len(b._st) > SmallCompiled.initial_states                 # the arrays grew
    assert b._compactions > 0                                         # and the pool was compacted


@pytest.mark.parametrize("seed", range(3))
def test_same_drafts_as_python_when_the_size_bound_evicts_and_freezes(seed):
    a = DraftTrees(max_depth=10, max_match=4, max_nodes=700)
    b = SmallCompiled(max_depth=10, max_match=4, max_nodes=700)
    seen = drive(a, b, 100 + seed, steps=800, keys=20, max_live=3, rebuild=seed > 0)
    st = b.stats()
    assert st["evicted_keys"] > 0
    assert seen["frozen"] > 0 or seed > 0      # without rebuilds the shared key fills the bound
    assert st["nodes"] <= 700


def test_state_dict_round_trip_between_implementations():
    a = DraftTrees(max_depth=12, max_match=5)
    b = CompiledDraftTrees(max_depth=12, max_match=5)
    drive(a, b, 7, steps=300)
    for src in (a, b):
        for cls in (DraftTrees, CompiledDraftTrees):
            restored = cls.from_state_dict(src.state_dict())
            restored.start("x", "p0", [1, 2])
            ref = DraftTrees.from_state_dict(a.state_dict())
            ref.start("x", "p0", [1, 2])
            assert restored.propose_scored("x", 8, 0.0) == ref.propose_scored("x", 8, 0.0)
            assert restored.stats()["nodes"] == ref.stats()["nodes"]


def test_tree_drafter_drafts_the_same_with_either_implementation():
    """TreeDrafter (shared tree, its rebuild, own drafts) over both: the same drafts every step."""
    rng = random.Random(3)
    drafters = [TreeDrafter(8, 4096, {"impl": impl, "shared_nodes": 300}) for impl in ("python", "compiled")]
    assert isinstance(drafters[1].trees, CompiledDraftTrees) and type(drafters[0].trees) is DraftTrees
    base = [rng.randrange(9) for _ in range(40)]
    for rollout in range(6):
        seqs = {f"{rollout}/{i}": [5, 6] + mutated(rng, base, 9) for i in range(6)}
        own = {rid: tuple(mutated(rng, base, 9)) if i % 2 else () for i, rid in enumerate(seqs)}
        pos = dict.fromkeys(seqs, 3)
        while any(pos[r] <= len(s) for r, s in seqs.items()):
            running = [r for r in seqs if pos[r] <= len(seqs[r])]
            out = []
            for d in drafters:
                d.begin_step(len(running))
                out.append([d.request(r, lambda r=r: RequestOpts(f"p{rollout % 2}", 2, 2, False, own[r]),
                                      lambda a, b, s=seqs[r]: s[a:b], pos[r]) for r in running])
                d.end_step()
            assert out[0] == out[1]
            for r, draft in zip(running, out[0]):
                pos[r] += 1 + len(draft) if draft == seqs[r][pos[r]:pos[r] + len(draft)] else 1
        for d in drafters:
            d.begin_step(0)
            d.end_step()
    stats = [d.take_stats() for d in drafters]
    for key in ("draft_tokens", "accepted_tokens", "shared_draft_tokens", "own_draft_tokens", "nodes", "shared_nodes"):
        assert stats[0][key] == stats[1][key], key
    assert stats[0]["shared_draft_tokens"] > 0 and stats[0]["accepted_tokens"] > 0


def test_unknown_implementation_is_refused():
    with pytest.raises(ValueError, match="unknown draft trees impl 'cython'"):
        TreeDrafter(8, 4096, {"impl": "cython"})


def test_compiled_trees_without_numba_fail_before_the_engine_starts(monkeypatch):
    """Without numba the compiled trees cannot load: the engines' settings check (run where an engine
    is started, before vLLM or SGLang loads anything) says so in one line and names the way out; the
    Python trees still work."""
    monkeypatch.delitem(sys.modules, "megatron_specrl.rollout.tree_drafting.compiled_trees")
    monkeypatch.setitem(sys.modules, "numba", None)        # `import numba` raises ImportError
    for build in (lambda: settings_env(impl="compiled"), lambda: TreeDrafter(8, 4096, {"impl": "compiled"})):
        with pytest.raises(ImportError) as err:
            build()
        message = str(err.value)
        assert "\n" not in message and "needs numba" in message and "rollout.drafter.impl=python" in message
    assert '"impl": "python"' in settings_env(impl="python")
    assert type(TreeDrafter(8, 4096, {"impl": "python"}).trees) is DraftTrees
    with pytest.raises(ValueError, match="unknown draft trees impl 'cython'"):
        settings_env(impl="cython")


# ---- Review tests for the draft trees: the compiled automata against the Python ones on inputs the

class _SmallCompiledTrees(CompiledDraftTrees):
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
    a, b = DraftTrees(depth, match, nodes), _SmallCompiledTrees(depth, match, nodes)
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
            b = _SmallCompiledTrees.from_state_dict(b.state_dict(), max_nodes=bound)
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
