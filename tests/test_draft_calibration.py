"""The drafter's calibration of tree frequencies (engines/tree_drafter.Calibration): the trees' walk
under a per-source factor kappa, the first-token check that learns kappa from what the engine
samples, and its place in checkpoints. Without vLLM: TreeDrafter is driven as the engines drive it."""

import pytest

from megatron_specrl.engines.tree_drafter import (
    CALIBRATION_SUMS, SHARED_KEY, RequestOpts, TreeDrafter, trees_class,
)

IMPLS = ["python", "compiled"]
CHAIN = list(range(10, 40))     # one earlier response: every node of its path has a single child


def _trees(impl, *seqs, key="p"):
    t = trees_class(impl)(max_depth=48, max_match=16, max_nodes=100_000)
    for s in seqs:
        t.insert(key, s)
    return t


@pytest.mark.parametrize("impl", IMPLS)
def test_kappa_scales_each_step_of_the_walk(impl):
    t = _trees(impl, CHAIN)
    t.start("r", "p", CHAIN[:2])
    assert t.propose_scored("r", 16, 0.1) == t.propose_scored("r", 16, 0.1, kappa=1.0)
    raw, score = t.propose_scored("r", 16, 0.1)
    assert raw == CHAIN[2:18] and score == pytest.approx(16.0)          # a path seen once: frequency 1
    cut, score = t.propose_scored("r", 16, 0.1, kappa=0.5)
    assert cut == CHAIN[2:5]                                            # 0.5^3 >= 0.1 > 0.5^4
    assert score == pytest.approx(0.5 + 0.25 + 0.125)
    assert t.propose_scored("r", 16, 0.1, kappa=0.05)[0] == []           # below min_prob at the first token


@pytest.mark.parametrize("impl", IMPLS)
def test_first_token_and_its_frequency_come_back_whatever_the_cut(impl):
    t = _trees(impl, [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 5, 6])
    t.start("r", "p", [1, 2])
    draft, src, firsts = t.extend_and_propose(["r"], [], 4, 0.1, kappas=[0.01])
    assert draft == [] and src == 0
    assert firsts[0][0] == 3 and firsts[0][1] == pytest.approx(2 / 3)   # 3 follows [1, 2] twice in three
    t.start("n", "p", [99])                                            # no continuation anywhere
    assert t.extend_and_propose(["n"], [], 4, 0.1)[2] == ((-1, 0.0),)


def test_both_implementations_agree_under_calibration():
    seqs = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [9, 2, 3, 4, 5, 1, 2, 3, 4]]
    a, b = _trees("python", *seqs), _trees("compiled", *seqs)
    for t in (a, b):
        for s in seqs:
            t.insert(SHARED_KEY, s)
        t.start("r", "p", [1])
        t.start(("r", "s"), SHARED_KEY, [1])
    for kappas in ([1.0, 1.0], [0.9, 0.3], [0.4, 0.95], [0.05, 0.05]):
        for tokens in ([], [2], [3, 4]):
            got = [t.extend_and_propose(["r", ("r", "s")], tokens, 8, 0.1, kappas=kappas) for t in (a, b)]
            assert got[0][:2] == got[1][:2]
            assert [f[0] for f in got[0][2]] == [f[0] for f in got[1][2]]
            assert [f[1] for f in got[0][2]] == pytest.approx([f[1] for f in got[1][2]])


def _opts(key):
    return lambda: RequestOpts(key, 0, 0)


def _run(d, seqs, steps, gain=1):
    """Drive the drafter as an engine does: each step every request gains `gain` tokens of its
    sequence (what the engine sampled) and gets a draft; returns the drafts of the last step."""
    pos = dict.fromkeys(seqs, 0)
    drafts = {}
    for _ in range(steps):
        d.begin_step(len(seqs))
        for rid, seq in seqs.items():
            pos[rid] += gain
            drafts[rid] = d.request(rid, _opts(rid.split("/")[0]), lambda a, b, s=seq: s[a:b], pos[rid], gain)
        d.end_step()
    return drafts


def _interleaved(i):
    """CHAIN with a token no tree holds after each of its tokens: after a CHAIN token the tree
    proposes the next one (frequency 1), the engine samples the other."""
    return [t for c in CHAIN[:15] for t in (c, 300 + 20 * i + c % 20)]


PROMPTS = [f"p{i}" for i in range(8)]


def test_a_source_whose_first_tokens_do_not_come_true_drafts_less_then_recovers():
    d = TreeDrafter(16, 4096, {"impl": "python", "shared_nodes": 0, "token_budget": 10_000})
    d.add_responses([(p, CHAIN) for p in PROMPTS])
    assert d.calibration.kappas()[0] == 1.0
    _run(d, {f"{p}/0": _interleaved(i) for i, p in enumerate(PROMPTS)}, 4)
    kappa = d.calibration.kappas()[0]
    assert kappa < 0.2
    c = d.take_stats()
    assert c["calib_prompt_hits"] == 0 and c["calib_prompt_expected"] == 16     # 8 misses at frequency 1, twice
    # a request that now follows the old response drafts one token, not 15, in a full batch (the
    # tail's lower cut-off would let it draft further)
    d.begin_step(600)
    draft = d.request("p0/x", _opts("p0"), lambda a, b: CHAIN[a:b], 2, 2)
    d.end_step()
    assert draft == CHAIN[2:3]
    # samples that follow the trees' paths: the evidence turns (it decays by a fifth a step)
    _run(d, {f"{p}/f": list(CHAIN) for p in PROMPTS}, 12)
    assert d.calibration.kappas()[0] > 0.9
    assert d.take_stats()["calib_prompt_hits"] > 0


def test_calibration_off_leaves_the_drafts_as_the_raw_frequencies_give_them():
    d = TreeDrafter(16, 4096, {"impl": "python", "shared_nodes": 0, "calibrate": False, "token_budget": 10_000})
    assert d.calibration is None
    d.add_responses([(p, CHAIN) for p in PROMPTS])
    _run(d, {f"{p}/0": _interleaved(i) for i, p in enumerate(PROMPTS)}, 4)
    d.begin_step(600)
    assert d.request("p0/x", _opts("p0"), lambda a, b: CHAIN[a:b], 2, 2) == CHAIN[2:17]
    assert all(d.counters[k] == 0 for k in CALIBRATION_SUMS)


def test_calibration_travels_with_the_trees_in_checkpoints(tmp_path):
    from megatron_specrl.rollout.draft_tree import DraftTrees
    d = TreeDrafter(16, 4096, {"impl": "python", "shared_nodes": 0})
    d.add_responses([(p, CHAIN) for p in PROMPTS])
    _run(d, {f"{p}/0": _interleaved(i) for i, p in enumerate(PROMPTS)}, 4)
    DraftTrees.save_state(d.state_dict(), tmp_path / "t")
    restored = TreeDrafter(16, 4096, {"impl": "compiled", "shared_nodes": 0})
    restored.load_state_dict(DraftTrees.load_state(tmp_path / "t"))
    assert restored.calibration.kappas() == pytest.approx(d.calibration.kappas())
    assert restored.calibration.kappas()[0] < 1.0
    # a state written before the calibration existed loads with the prior
    old_state = DraftTrees.load_state(tmp_path / "t")
    del old_state["calibration"]
    fresh = TreeDrafter(16, 4096, {"impl": "python", "shared_nodes": 0})
    fresh.load_state_dict(old_state)
    assert fresh.calibration.kappas() == (1.0, 1.0)
