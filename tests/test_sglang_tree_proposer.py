"""Tree drafting through SGLang 0.5.23's NGRAM worker, at its API boundary, on CPU.

SGLang cannot run here, so a fake `sglang` package carries NGRAMWorker and Scheduler classes for the
version-pinned patch to replace methods on, and fake batches carry what the patched
`NGRAMWorker._prepare_draft_tokens(batch)` reads upstream: `batch.reqs[i].rid`,
`.origin_input_ids_unpadded`, `.output_ids`, `.sampling_params.custom_params`,
`batch.grammar_needs_sync()` and, under the overlap scheduler, `batch.spec_info.accept_tokens /
accept_lens`; the worker's `draft_token_num`, `enable_overlap`, `model_runner.model_config.context_len`.
What comes back (draft ids and a tree mask, draft_token_num nodes per request) is read as SGLang
reads it: the tree links of `reconstruct_indices_from_tree_mask`'s documented contract, and a greedy
verify along them (verify_tree_greedy), which also produces each step's accepted tokens.
"""

from __future__ import annotations

import sys
import types
from array import array
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_specrl.engines import sglang_engine as se
from megatron_specrl.engines.protocol import GenerateRequest, SamplingSettings
from megatron_specrl.engines.tree_drafter import DRAFT_KEY, OWN_DRAFT, RESPONSE_START, settings_env
from patches import sglang_0_5_23_tree_proposer as patch
from patches import sglang_engine_patches


# -- fake sglang -------------------------------------------------------------------------------
@pytest.fixture
def fake_sglang(monkeypatch):
    """A `sglang` package with the two classes the patch targets (their own methods only record)."""
    calls = []

    class NGRAMWorker:
        def _prepare_draft_tokens(self, batch):
            calls.append("upstream prepare")

        def _update_ngram_corpus(self, batch):
            calls.append("upstream update")

    class Scheduler:
        pass

    rank = SimpleNamespace(tp_rank=0)
    mods = {"sglang": types.ModuleType("sglang"), "sglang.srt": types.ModuleType("sglang.srt"),
            "sglang.srt.speculative": types.ModuleType("sglang.srt.speculative"),
            "sglang.srt.speculative.ngram_worker": types.ModuleType("sglang.srt.speculative.ngram_worker"),
            "sglang.srt.managers": types.ModuleType("sglang.srt.managers"),
            "sglang.srt.managers.scheduler": types.ModuleType("sglang.srt.managers.scheduler"),
            "sglang.srt.runtime_context": types.ModuleType("sglang.srt.runtime_context")}
    mods["sglang"].__version__ = "0.5.23"
    mods["sglang.srt.speculative.ngram_worker"].NGRAMWorker = NGRAMWorker
    mods["sglang.srt.managers.scheduler"].Scheduler = Scheduler
    mods["sglang.srt.runtime_context"].get_parallel = lambda: rank
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setenv(patch.SETTINGS_ENV, settings_env(min_prob=0.0, token_budget=2048))
    yield SimpleNamespace(NGRAMWorker=NGRAMWorker, Scheduler=Scheduler, calls=calls, rank=rank,
                          module=mods["sglang"])
    patch.revert()


@pytest.fixture
def worker(fake_sglang):
    assert patch.apply()
    return make_worker(fake_sglang)


def make_worker(fake, draft_token_num=5, overlap=False, context_len=256):
    w = fake.NGRAMWorker()
    w.draft_token_num = draft_token_num
    w.enable_overlap = overlap
    w.model_runner = SimpleNamespace(model_config=SimpleNamespace(context_len=context_len))
    return w


class Req:
    def __init__(self, rid, prompt, key=None, response_start=None, custom=None):
        self.rid = rid
        self.origin_input_ids_unpadded = array("q", prompt)
        self.output_ids = array("q")
        params = dict(custom or {})
        if key is not None:
            params.update({DRAFT_KEY: key, RESPONSE_START: len(prompt) if response_start is None else response_start})
        self.sampling_params = SimpleNamespace(custom_params=params or None)
        self.is_retracted, self.finished_reason = False, None   # as Req: set by reset_for_retract / on finish

    def finished(self):
        return self.finished_reason is not None


class Batch:
    def __init__(self, reqs, n):
        self.reqs, self.n = reqs, n
        self.spec_info = SimpleNamespace(accept_tokens=torch.zeros(len(reqs) * n, dtype=torch.int64),
                                         accept_lens=torch.zeros(len(reqs), dtype=torch.int32))

    def grammar_needs_sync(self):
        return False


# -- reading the result as SGLang does ----------------------------------------------------------
def links(mask, bs, n):
    """reconstruct_indices_from_tree_mask's contract: parent = the largest strict ancestor; first
    child = the smallest later node with this one as ancestor; next sibling = the smallest later
    node with the same parent (none without a parent)."""
    m = mask.reshape(bs, n, n)
    parent = np.full((bs, n), -1)
    nxt = np.full((bs, n), -1)
    sib = np.full((bs, n), -1)
    for b in range(bs):
        for i in range(n):
            anc = [j for j in range(i) if m[b, i, j]]
            parent[b, i] = anc[-1] if anc else -1
        for i in range(n):
            kids = [k for k in range(i + 1, n) if m[b, k, i]]
            nxt[b, i] = kids[0] if kids else -1
            if parent[b, i] >= 0:
                later = [k for k in range(i + 1, n) if parent[b, k] == parent[b, i]]
                sib[b, i] = later[0] if later else -1
    return parent, nxt, sib


def reachable_path(tokens, mask, bs, n):
    """Per request: the draft tokens verification can reach from the root (asserting a chain)."""
    parent, nxt, sib = links(mask, bs, n)
    paths = []
    for b in range(bs):
        path, cur = [], nxt[b, 0]
        while cur != -1:
            assert sib[b, cur] == -1, "our drafts are chains"
            path.append(int(tokens[b * n + cur]))
            cur = nxt[b, cur]
        paths.append(path)
    return paths, parent


def greedy_verify(path, target):
    """verify_tree_greedy on a chain: accept while the draft equals the target's choice, then the
    target's token (bonus). `target` lists the target's greedy tokens from the root on."""
    accepted = []
    for tok, want in zip(path, target):
        if tok != want:
            break
        accepted.append(tok)
    return accepted + [target[len(accepted)]]


def step(w, batch):
    tokens, mask = w._prepare_draft_tokens(batch)
    n, bs = w.draft_token_num, len(batch.reqs)
    assert tokens.shape == (bs * n,) and mask.shape == (bs * n * n,) and mask.dtype == bool
    paths, parent = reachable_path(tokens, mask, bs, n)
    for b, r in enumerate(batch.reqs):   # node 0 is the request's last token; padding is unreachable
        seq = list(r.origin_input_ids_unpadded) + list(r.output_ids)
        if w.enable_overlap:
            seq += batch.spec_info.accept_tokens[b * n:b * n + int(batch.spec_info.accept_lens[b])].tolist()
        assert tokens[b * n] == seq[-1]
        assert all(parent[b, j] == -1 for j in range(1 + len(paths[b]), n))
    return paths


# -- tests ----------------------------------------------------------------------------------------
def test_drafts_come_from_each_requests_prompt_tree(worker):
    d = patch.drafter_of(worker)
    d.trees.insert("p", [7, 8, 9, 10])
    d.trees.insert("q", [7, 20, 21, 22])
    b = Batch([Req("a", [1, 2], "p"), Req("b", [1, 2], "q"), Req("c", [1, 2], custom={"other": 1})], n=5)
    for r in b.reqs:
        r.output_ids.append(7)            # the token of the prefill step
    assert step(worker, b) == [[8, 9, 10], [20, 21, 22], []]   # c carries no draft key: no draft
    assert patch.drafter_of(worker) is d  # one drafter per worker, kept across steps


def test_siblings_draft_from_each_other_in_flight_and_the_counters_add_up(worker):
    b = Batch([Req("a", [50, 51], "q"), Req("b", [50, 51], "q")], n=5)
    b.reqs[0].output_ids.extend([1, 2, 3, 4, 5])   # a is ahead: its tokens reach the tree this step
    b.reqs[1].output_ids.append(1)
    first = step(worker, b)
    assert first[1] == [2, 3, 4, 5]
    # b's target continues 2 3 4 7: three draft tokens accepted, 7 from the target
    gained = greedy_verify(first[1], [2, 3, 4, 7, 0])
    assert gained == [2, 3, 4, 7]
    b.reqs[1].output_ids.extend(gained)
    assert first[0] == []                          # nothing follows a's own last token yet
    b.reqs[0].output_ids.append(6)
    second = step(worker, b)
    stats = patch.drafter_of(worker).take_stats()
    assert stats["accepted_tokens"] == 3 and stats["engine_steps"] == 2
    assert stats["generated_tokens"] == 5 + 1 + 1 + 4 and stats["request_steps"] == 4
    assert stats["draft_tokens"] == sum(map(len, first + second))
    assert patch.drafter_of(worker).take_stats()["draft_tokens"] == 0


def test_overlap_scheduler_tokens_come_from_spec_info_once(fake_sglang):
    """Under the overlap scheduler the last round's accepted tokens are in spec_info, not yet in
    output_ids; when output_ids catch up next round they must not enter the tree twice."""
    assert patch.apply()
    w = make_worker(fake_sglang, overlap=True)
    d = patch.drafter_of(w)
    d.trees.insert("q", [1, 2, 3, 4, 5, 6])
    b = Batch([Req("a", [50, 51], "q")], n=5)
    b.spec_info.accept_tokens[:1] = torch.tensor([1])
    b.spec_info.accept_lens[0] = 1
    assert step(w, b) == [[2, 3, 4, 5]]
    b.reqs[0].output_ids.append(1)                         # round 1 processed
    b.spec_info.accept_tokens[:3] = torch.tensor([2, 3, 9])  # round 2: two accepted + 9
    b.spec_info.accept_lens[0] = 3
    assert step(w, b) == [[]]                              # 1 2 3 9 is off every path of the tree
    b.reqs[0].output_ids.extend([2, 3, 9])
    b.spec_info.accept_lens[0] = 0
    step(w, b)
    stats = d.take_stats()
    assert stats["generated_tokens"] == 1 + 3 and stats["accepted_tokens"] == 2
    assert d.trees.stats()["active_requests"] == 2          # in its prompt's tree and in the shared tree


def test_draft_length_follows_the_batch_and_the_context(fake_sglang, monkeypatch):
    monkeypatch.setenv(patch.SETTINGS_ENV, settings_env(min_prob=0.0, token_budget=20))
    assert patch.apply()
    w = make_worker(fake_sglang, draft_token_num=9)       # 8 draft nodes at most
    d = patch.drafter_of(w)
    assert d.max_k == 8 and d.draft_len(1) == 8 and d.draft_len(4) == 4 and d.draft_len(10) == 1
    d.trees.insert("q", list(range(100, 120)))
    one = Batch([Req("a", [1], "q")], n=9)
    one.reqs[0].output_ids.append(100)
    assert step(w, one) == [list(range(101, 109))]
    four = Batch([Req(f"r{i}", [1], "q") for i in range(4)], n=9)
    for r in four.reqs:
        r.output_ids.append(100)
    assert step(w, four) == [[101, 102, 103, 104]] * 4     # 20 // 4 - 1 = 4 nodes each, the rest padding
    short = make_worker(fake_sglang, draft_token_num=9, context_len=6)
    patch.drafter_of(short).trees.insert("q", list(range(100, 120)))
    tail = Batch([Req("z", [1, 2, 3], "q")], n=9)
    tail.reqs[0].output_ids.append(100)
    assert step(short, tail) == [[101]]                    # room for 6 - 4 - 1 draft tokens


def test_response_start_and_finished_requests(worker):
    """An extension's prompt ends with its accepted prefix (part of the response); requests that leave
    the decode batch are finished in the tree, which keeps their tokens."""
    d = patch.drafter_of(worker)
    d.trees.insert("q", [7, 8, 9, 10, 11])
    ext = Batch([Req("ext", [50, 51, 7, 8], "q", response_start=2)], n=5)
    ext.reqs[0].output_ids.append(9)
    assert step(worker, ext) == [[10, 11]]
    assert d.trees.stats()["active_requests"] == 2          # in its prompt's tree and in the shared tree
    step(worker, Batch([Req("other", [3], None)], n=5))
    assert d.trees.stats()["active_requests"] == 0 and d.trees.has_key("q")


def test_a_retracted_request_goes_on_where_it_was(worker):
    """SGLang's retract_decode (decode memory full) sends a request back to the waiting queue with its
    output_ids kept; it is prefilled again later. The drafter keeps its place meanwhile: starting it
    over would enter its whole response into the trees a second time. A request that left the batch
    finished, or one the scheduler dropped while it waited (aborted), is over."""
    d = patch.drafter_of(worker)
    a, b, c = Req("a", [50], "q"), Req("b", [50], "q"), Req("c", [50], "q")
    a.output_ids.extend([1, 2, 3])
    b.output_ids.append(1)
    c.output_ids.append(1)
    step(worker, Batch([a, b, c], n=5))
    b.is_retracted = True                   # retracted: waits, its output_ids kept
    c.finished_reason = "stop"              # finished
    a.output_ids.append(4)
    step(worker, Batch([a], n=5))
    assert d.trees.stats()["active_requests"] == 4     # a and b, each in its prompt's and the shared tree
    b.is_retracted = False                  # prefilled again: one more token
    a.output_ids.append(5)
    b.output_ids.append(2)
    step(worker, Batch([a, b], n=5))
    assert d.trees.count("q", [1]) == 3 and d.trees.count("q", [1, 2]) == 2
    assert d.trees.stats()["sequences"] == 6           # one per request in each tree
    assert patch.drafter_of(worker).take_stats()["generated_tokens"] == 3 + 1 + 1 + 1 + 1 + 1
    d2 = Req("d", [50], "q")
    d2.output_ids.append(1)
    step(worker, Batch([a, d2], n=5))
    d2.is_retracted = True
    step(worker, Batch([a], n=5))
    assert d.trees.stats()["active_requests"] == 4     # d waits
    del d2                                  # aborted in the waiting queue: the scheduler drops it
    step(worker, Batch([a], n=5))
    assert d.trees.stats()["active_requests"] == 2


def test_patch_is_pinned_gated_and_reversible(fake_sglang, monkeypatch):
    W, S = fake_sglang.NGRAMWorker, fake_sglang.Scheduler
    upstream = W._prepare_draft_tokens
    assert patch.apply() and patch.is_applied()
    assert W._prepare_draft_tokens is patch._prepare_draft_tokens and S.specrl_tree_rpc is patch.specrl_tree_rpc
    W()._update_ngram_corpus(None)
    assert fake_sglang.calls == []                         # SGLang's corpus is left unused
    patch.revert()
    assert W._prepare_draft_tokens is upstream and not hasattr(S, "specrl_tree_rpc")
    fake_sglang.module.__version__ = "0.5.22"
    assert not patch.apply() and W._prepare_draft_tokens is upstream
    fake_sglang.module.__version__ = "0.5.23"
    monkeypatch.delenv(patch.SETTINGS_ENV)
    assert not patch.apply()                               # only in processes our engine configured
    monkeypatch.setenv(patch.SETTINGS_ENV, settings_env())
    monkeypatch.delenv(sglang_engine_patches.ENV, raising=False)
    sglang_engine_patches.plugin()
    assert not patch.is_applied()                          # the entry point acts only when marked
    monkeypatch.setenv(sglang_engine_patches.ENV, "1")
    sglang_engine_patches.plugin()
    assert patch.is_applied()


def test_plugin_entry_point_is_declared():
    from pathlib import Path
    text = (Path(__file__).resolve().parent.parent / "setup.py").read_text()
    assert f'"{se.PLUGIN_GROUP}": ["{se.PLUGIN_NAME}=patches.sglang_engine_patches:plugin"]' in text


# -- the engine side ------------------------------------------------------------------------------
def test_payload_carries_the_draft_key_in_custom_params():
    reqs = [GenerateRequest([1, 2, 3], 8, draft_key="p7", response_start=2),
            GenerateRequest([1, 2], 8),
            GenerateRequest([4, 5], 8, draft_key="p8", response_start=2, ban_first_token=9)]
    s = SamplingSettings(temperature=1.0)
    params = se.build_generate_payload(reqs, s, ban_processor="proc", draft="tree")["sampling_params"]
    assert params[0]["custom_params"] == {DRAFT_KEY: "p7", RESPONSE_START: 2}
    assert "custom_params" not in params[1]
    assert params[2]["custom_params"] == {DRAFT_KEY: "p8", RESPONSE_START: 2, se.BAN_PARAM: 9}
    plain = se.build_generate_payload(reqs[:1], s, draft="none")["sampling_params"]
    assert "custom_params" not in plain[0]
    with pytest.raises(NotImplementedError, match="run-ahead"):
        se.build_generate_payload([GenerateRequest([1], 4, draft_key="p", response_start=1, runahead=True)], s, draft="tree")


def test_own_draft_travels_in_custom_params_and_is_drafted_first(worker):
    """rollout.verify=decode through SGLang: the sample's last response rides in custom_params and
    the NGRAM worker's drafter proposes it (not the tree's most frequent path) while the response
    follows it."""
    req = GenerateRequest([50, 51], 8, draft_key="q", response_start=2, own_draft=[1, 7, 8, 9])
    custom = se.build_generate_payload([req], SamplingSettings(), draft="tree")["sampling_params"][0]["custom_params"]
    assert custom == {DRAFT_KEY: "q", RESPONSE_START: 2, OWN_DRAFT: [1, 7, 8, 9]}
    d = patch.drafter_of(worker)
    for _ in range(3):
        d.trees.insert("q", [1, 2, 3, 4])
    b = Batch([Req("own", [50, 51], custom=custom), Req("plain", [50, 51], "q")], n=5)
    for r in b.reqs:
        r.output_ids.append(1)
    assert step(worker, b) == [[7, 8, 9], [2, 3, 4]]
    with pytest.raises(ValueError, match="own draft"):
        se.build_generate_payload([GenerateRequest([1], 4, own_draft=[2])], SamplingSettings(), draft="tree")


class FakeEngine:
    """sglang.Engine's calls the tree needs: generate, and collective_rpc(method, **kwargs), which
    SGLang runs as getattr(scheduler, method)(**kwargs) in each scheduler and answers with nothing."""

    def __init__(self, scheduler):
        self.scheduler, self.payloads = scheduler, []

    def generate(self, **kw):
        self.payloads.append(kw)
        return [{"output_ids": [5], "meta_info": {"output_token_logprobs": [(-0.5, 5, None)],
                                                  "finish_reason": {"type": "length"}}}
                for _ in kw["input_ids"]]

    def collective_rpc(self, method, **kwargs):
        getattr(self.scheduler, method)(**kwargs)


def test_engine_builds_ngram_server_args_and_reads_the_trees(fake_sglang, monkeypatch, tmp_path):
    monkeypatch.setenv(patch.SETTINGS_ENV, "")     # restored after the test: the engine sets both
    monkeypatch.setenv(sglang_engine_patches.ENV, "0")
    scheduler = fake_sglang.Scheduler()
    eng = se.SGLangEngine("m", engine=FakeEngine(scheduler), draft="tree", draft_tokens=6,
                          draft_settings={"min_prob": 0.0, "token_budget": 64}, log_dir=tmp_path,
                          use_ban_processor=False)
    a = eng.server_args
    assert a["speculative_algorithm"] == "NGRAM" and a["speculative_num_draft_tokens"] == 7
    assert a["speculative_ngram_max_bfs_breadth"] == 1 and a["speculative_ngram_min_bfs_breadth"] == 1
    assert a["speculative_accept_threshold_single"] == 1.0 and a["speculative_accept_threshold_acc"] == 1.0
    import json
    import os
    assert json.loads(os.environ[patch.SETTINGS_ENV])["token_budget"] == 64
    assert os.environ[sglang_engine_patches.ENV] == "1"
    out = eng.generate([GenerateRequest([1, 2], 1, draft_key="p", response_start=2)], SamplingSettings(), 0)
    assert out[0].token_ids == [5]
    assert eng.engine.payloads[0]["sampling_params"][0]["custom_params"] == {DRAFT_KEY: "p", RESPONSE_START: 2}

    # in the scheduler: the patched worker drafted one step; the engine reads counters and trees back
    assert patch.apply()
    scheduler.draft_worker = make_worker(fake_sglang, draft_token_num=7)
    b = Batch([Req("a", [1, 2], "p")], n=7)
    b.reqs[0].output_ids.extend([3, 4])
    step(scheduler.draft_worker, b)
    stats = eng.draft_stats()
    assert stats["generated_tokens"] == 2 and stats["keys"] == 1 and stats["nodes"] > 0
    state = eng.draft_state()
    scheduler.draft_worker = make_worker(fake_sglang, draft_token_num=7)
    assert not patch.drafter_of(scheduler.draft_worker).trees.has_key("p")
    eng.load_draft_state(state)
    assert patch.drafter_of(scheduler.draft_worker).trees.has_key("p")
    fake_sglang.rank.tp_rank = 1                   # other ranks keep their own copy and write nothing
    path = tmp_path / "r1.pkl"
    scheduler.specrl_tree_rpc("take_stats", str(path))
    assert not path.exists()
    with pytest.raises(ValueError, match="unknown tree call"):
        scheduler.specrl_tree_rpc("reset", str(path))


def test_engines_without_tree_drafting_or_the_rpc_say_so(tmp_path):
    eng = se.SGLangEngine("m", engine=FakeEngine(None), log_dir=tmp_path, use_ban_processor=False)
    assert "speculative_algorithm" not in eng.server_args
    assert eng.draft_stats() == {} and eng.draft_state() is None
    with pytest.raises(ValueError, match="without tree drafting"):
        eng.load_draft_state({})
    http = se.SGLangHTTPEngine("http://x", log_dir=tmp_path, use_ban_processor=False, draft="tree",
                               post=lambda path, body: {"success": True})
    with pytest.raises(NotImplementedError, match="collective_rpc"):
        http.draft_stats()
    with pytest.raises(ValueError, match="draft must be"):
        se.SGLangEngine("m", engine=FakeEngine(None), log_dir=tmp_path, use_ban_processor=False, draft="ngram")


def first_token_distribution(tokens, mask, n, p):
    """Exact law of the first committed token under tree_speculative_sampling_target_only (thresholds
    1): the root's children are tried in link order, child c accepted while the coin is below the
    running sum of p over the children tried; otherwise the token comes from relu(p - p_tried)."""
    _, nxt, sib = links(mask, 1, n)
    law, acc, tried, cur = np.zeros_like(p), 0.0, np.zeros_like(p), nxt[0, 0]
    while cur != -1:
        t = int(tokens[cur])
        law[t] += min(1.0, acc + p[t]) - min(1.0, acc)
        acc += p[t]
        tried[t] = p[t]
        cur = sib[0, cur]
    rest = np.maximum(p - tried, 0)
    return law + max(0.0, 1 - min(acc, 1.0)) * rest / rest.sum()


def test_chain_with_unreachable_padding_keeps_the_target_law(worker):
    """Our padding leaves the verified law equal to p; upstream's (token 0 as extra root children)
    would count p(0) once per padding node."""
    p = np.array([0.2, 0.5, 0.3])
    d = patch.drafter_of(worker)
    d.trees.insert("q", [2, 1, 1])
    b = Batch([Req("a", [1], "q")], n=5)
    b.reqs[0].output_ids.append(2)
    tokens, mask = worker._prepare_draft_tokens(b)
    assert reachable_path(tokens, mask, 1, 5)[0] == [[1, 1]]        # two padding nodes
    np.testing.assert_allclose(first_token_distribution(tokens, mask, 5, p), p)
    upstream = mask.reshape(5, 5).copy()
    upstream[3:, :] = False
    upstream[3, [0, 3]] = upstream[4, [0, 4]] = True                 # padding as children of the root
    law = first_token_distribution(np.where(np.arange(5) >= 3, 0, tokens), upstream.reshape(-1), 5, p)
    assert law[0] == pytest.approx(2 * p[0])                         # not the target's law
