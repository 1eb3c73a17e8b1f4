"""TreeProposer's bookkeeping without vLLM: a fake input batch drives propose_batch as the patched
runner does (rows of token ids, request ids, the tokens sampled this step)."""

import json
from types import SimpleNamespace

import numpy as np
import pytest

from megatron_specrl.engines import tree_proposer as tp
from megatron_specrl.engines.tree_drafter import SHARED_KEY


EOS = 2


def _proposer(monkeypatch, k=8, max_model_len=256, **settings):
    monkeypatch.setenv(tp.SETTINGS_ENV, tp.settings_env(**settings))
    cfg = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k),
                          model_config=SimpleNamespace(max_model_len=max_model_len))
    return tp.TreeProposer(cfg)


class Batch:
    """The runner's view: token rows, no-spec lengths, request ids; requests carry extra_args."""

    def __init__(self):
        self.token_ids_cpu = np.zeros((4, 256), dtype=np.int64)
        self.num_tokens_no_spec = np.zeros(4, dtype=np.int64)
        self.req_ids, self.requests = [], {}

    def add(self, req_id, prompt, key, response_start=None, own=None, max_tokens=None, stop_token_ids=None):
        """With max_tokens: vLLM's own SamplingParams (its EOS and stop tokens, as the input processor sets them)."""
        i = len(self.req_ids)
        self.req_ids.append(req_id)
        self.token_ids_cpu[i, :len(prompt)] = prompt
        self.num_tokens_no_spec[i] = len(prompt)
        extra = None if key is None else {tp.DRAFT_KEY: key, tp.RESPONSE_START: response_start or len(prompt)}
        if own is not None:
            extra[tp.OWN_DRAFT] = list(own)
        params = SimpleNamespace(extra_args=extra)
        if max_tokens is not None:
            from vllm import SamplingParams
            params = SamplingParams(max_tokens=max_tokens, stop_token_ids=stop_token_ids, extra_args=extra)
            params.update_from_generation_config({}, EOS)
        self.requests[req_id] = SimpleNamespace(prompt_token_ids=list(prompt), sampling_params=params)

    def sample(self, i, tokens):
        n = self.num_tokens_no_spec[i]
        self.token_ids_cpu[i, n:n + len(tokens)] = tokens
        self.num_tokens_no_spec[i] = n + len(tokens)
        return list(tokens)


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
    from megatron_specrl.engines import tree_drafter

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
    from megatron_specrl.engines.tree_drafter import add_step_cost, fit_step_cost

    rng = np.random.default_rng(0)
    sums = {}
    for _ in range(400):
        r, d = rng.integers(1, 129), rng.integers(0, 2000)
        add_step_cost(sums, r, d, (7.5 + 0.1 * r + 0.0167 * d + rng.normal(0, 0.3)) / 1000)
    a, b, c = fit_step_cost(sums)
    assert a == pytest.approx(7.5, abs=0.2) and b == pytest.approx(0.1, abs=0.005)
    assert c == pytest.approx(0.0167, abs=0.0005)
    assert fit_step_cost({k: v / 400 * 5 for k, v in sums.items()}) is None      # 5 steps: no fit
    flat = {}                                             # no step drafted: c cannot be told, and is 0
    for r in range(1, 50):
        add_step_cost(flat, r, 0, (5 + 0.07 * r) / 1000)
    a, b, c = fit_step_cost(flat)
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
        tp.settings_env(min_probability=0.1)
    assert json.loads(tp.settings_env(min_prob=0.3))["min_prob"] == 0.3


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
    b.requests["ahead"].sampling_params.extra_args[tp.RUNAHEAD] = True
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
