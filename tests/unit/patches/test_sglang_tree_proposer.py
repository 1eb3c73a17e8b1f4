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

SGLang 0.5.23's NGRAM worker and where a request ends: stop tokens and max_new_tokens.

What SGLang does (python/sglang/srt in 0.5.23):
- the verify (speculative/eagle_utils.py `eagle_sample`) accepts along the draft chain without looking
  at stop tokens or max_new_tokens, and adds the bonus token: a draft that contains a stop token,
  accepted, is followed by more accepted tokens; nothing in speculative/ reads max_new_tokens, and the
  verify width is draft_token_num whatever is left of the request;
- result processing (managers/scheduler_components/batch_result_processor.py
  `process_batch_result_decode`) extends `req.output_ids` with the whole accepted run and only then
  `Req.update_finish_state` (managers/schedule_batch.py) sets `finished_len` at the first stop token
  (stop_token_ids, eos_token_ids, tokenizer.eos_token_id, tokenizer.additional_stop_token_ids; none
  with ignore_eos) or at max_new_tokens; what is streamed is `output_ids_through_stop`;
- the overlap scheduler (managers/scheduler.py `event_loop_overlap`, SGLang's default on CUDA) builds
  and launches step N+1 before it processes step N's result, so a request whose step-N run holds the
  stop is still in step N+1's batch ("a finished row reappears for one overshoot tick"), and the
  patched `_prepare_draft_tokens` reads that run, tokens past the stop included, from
  `batch.spec_info.accept_tokens`. (`Scheduler._reqs_finishing_inflight` drops only requests whose
  next single token reaches max_new_tokens, so a run that crosses max_new_tokens reappears too.)

The fakes are those of tests/unit/patches/test_sglang_tree_proposer.py; `Req` here also carries the fields
`Req._check_token_based_finish` and `update_finish_state` read, with SGLang's defaults.

SGLang 0.5.23's NGRAM worker and a request's last verify step: its tokens reach the drafter once.

What SGLang does (python/sglang/srt in 0.5.23):
- the drafter learns a request's tokens when the worker prepares its next step's drafts
  (`NGRAMWorker._prepare_draft_tokens`); result processing of a decode/verify batch
  (managers/scheduler_components/batch_result_processor.py `process_batch_result_decode`) extends
  `req.output_ids` with the accepted run, `Req.update_finish_state` ends it (stop token, max_new_tokens,
  `to_finish` for aborts), and `_handle_finish_state_updated_req` then calls
  `draft_worker.note_request_finished(rid=..., natural_stop=...)` on the spec worker (a no-op in
  `BaseSpecWorker`, which NGRAMWorker does not override);
- without the overlap scheduler a finished request is filtered out before the next batch, so its last
  run would never be shown to the drafter; with it (`event_loop_overlap`) step N+1 is launched (its
  drafts prepared, step N's run read from `spec_info`) before step N's result is processed, so the
  finished request is shown once more, and processing of its overshoot tick skips it (`continue` on
  `req.finished()` under overlap) - unless `Scheduler._reqs_finishing_inflight` left it out of step
  N+1 (its next token reaches max_new_tokens: `Req.next_output_finishes_by_length`);
- when overlap is disabled for one batch (`is_disable_overlap_for_batch`, e.g. a grammar sync) the last
  result is processed after the next batch was built and before it is launched: a request finished by
  that processing is in the batch whose drafts are then prepared.

The fakes are those of tests/unit/patches/test_sglang_tree_proposer.py and tests/unit/patches/test_sglang_tree_proposer.py; `Req`
here also carries `finished_len`, `to_finish`, `update_finish_state` and
`next_output_finishes_by_length` as SGLang's Req has them (the token- and length-based parts), and
`process_decode_result` is `process_batch_result_decode` reduced to what reaches the drafter.

SGLang 0.5.23's NGRAM worker and a request that finishes in its prefill: its response reaches the trees once.

What SGLang does (python/sglang/srt in 0.5.23):
- a prefill runs through `NGRAMWorker.forward_batch_generation`'s non-verify branch
  (`_prepare_for_speculative_decoding` returns at once for a batch that is not a decode batch): the
  drafter is not called;
- `Scheduler.process_batch_result` (managers/scheduler.py) hands an extend batch's result to
  `SchedulerBatchResultProcessor.process_batch_result_prefill`
  (managers/scheduler_components/batch_result_processor.py), which skips requests already finished or
  retracted, appends the sampled token to `req.output_ids` and calls `Req.update_finish_state()` (a
  discarded output - failed KV load, unusable sampling mask - finishes the request through `to_finish`
  without appending); unlike the decode path it never calls the spec worker's `note_request_finished`;
- without the overlap scheduler the result is processed before the next batch is built and
  `get_next_batch_to_run` filters the finished request out: it is in no decode batch; with it
  (`event_loop_overlap`) the prefill's requests are merged into the next decode batch before the
  prefill's result is processed, except those whose next token reaches max_new_tokens
  (`Scheduler._reqs_finishing_inflight`): a stop-token-first request is drafted once (its token read
  from spec_info) before its prefill's result finishes it; when overlap is disabled for a batch (a
  grammar sync) the prefill's result is processed after the next batch was built, before it runs.

The fakes are those of tests/unit/patches/test_sglang_tree_proposer.py; the fake Scheduler's `process_batch_result`
dispatches as SGLang's does, to `process_prefill_result` (`process_batch_result_prefill` reduced to what
reaches the drafter) or to the decode processing of tests/unit/patches/test_sglang_tree_proposer.py.
"""

from __future__ import annotations
import sys
import types
from array import array
from types import SimpleNamespace
import numpy as np
import pytest
import torch
from megatron_specrl.engines import sglang as se
from megatron_specrl.engines.protocol import GenerateRequest, SamplingSettings
from megatron_specrl.rollout.tree_drafting.drafter import DRAFT_KEY, OWN_DRAFT, RESPONSE_START, settings_env
from megatron_specrl.patches import sglang_0_5_23_tree_proposer as patch
from megatron_specrl.patches import sglang_engine_patches
from megatron_specrl.rollout.tree_drafting.drafter import SHARED_KEY
from tests.helpers.paths import REPO_ROOT



# ---- Tree drafting through SGLang 0.5.23's NGRAM worker, at its API boundary, on CPU.

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
    text = (REPO_ROOT / "setup.py").read_text()
    assert f'"{se.PLUGIN_GROUP}": ["{se.PLUGIN_NAME}=megatron_specrl.patches.sglang_engine_patches:plugin"]' in text


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
    eng = se.SGLangEngine("m", engine=FakeEngine(scheduler), draft="tree",
                          drafter={"tokens": 6, "min_prob": 0.0, "token_budget": 64}, log_dir=tmp_path,
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


# ---- SGLang 0.5.23's NGRAM worker and where a request ends: stop tokens and max_new_tokens.



class StopReq(Req):
    """SamplingParams' max_new_tokens / stop_token_ids / ignore_eos (defaults 128, None, False), the
    request's eos_token_ids (the model config's) and the scheduler's tokenizer (None without one)."""

    def __init__(self, rid, prompt, key=None, max_new_tokens=128, stop_token_ids=None, ignore_eos=False,
                 eos_token_ids=None, tokenizer=None, **kw):
        super().__init__(rid, prompt, key, **kw)
        self.sampling_params.max_new_tokens = max_new_tokens
        self.sampling_params.stop_token_ids = stop_token_ids
        self.sampling_params.ignore_eos = ignore_eos
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer


def accepted_run(batch, b, tokens):
    """The overlap scheduler's view of step N's result at step N+1's draft preparation."""
    n = batch.n
    batch.spec_info.accept_tokens[b * n:b * n + len(tokens)] = torch.tensor(tokens)
    batch.spec_info.accept_lens[b] = len(tokens)


def test_tokens_after_a_stop_in_the_overshoot_tick_enter_no_tree_and_no_counter(fake_sglang):
    """Overlap scheduler: step N accepts 2 EOS and the bonus after it; SGLang ends the request at the
    EOS, but the request is in step N+1's batch and its run, bonus included, reaches the drafter."""
    assert patch.apply()
    w = make_worker(fake_sglang, overlap=True)
    d = patch.drafter_of(w)
    for _ in range(3):
        d.trees.insert("q", [1, 2, 99, 5, 6, 7])
    b = Batch([StopReq("a", [50, 51], "q", eos_token_ids={99})], n=5)
    accepted_run(b, 0, [1])                                  # the prefill's token, not yet in output_ids
    first = step(w, b)
    assert first == [[2, 99]]                                # SGLang would end the request at 99
    run = greedy_verify(first[0], [2, 99, 5, 6, 7, 8])      # the target agrees: 2 99, bonus 5
    b.reqs[0].output_ids.append(1)                           # step N-1 processed
    accepted_run(b, 0, run)                                  # step N's run, still in flight
    assert step(w, b) == [[]]                                # the request ended: no draft
    assert d.trees.count("q", [1, 2, 99]) == 4 and d.trees.count("q", [1, 2, 99, 5]) == 3
    stats = d.take_stats()
    assert stats["generated_tokens"] == 1 + 2 and stats["accepted_tokens"] == 2
    assert stats["draft_tokens"] == 2


def test_a_run_past_max_new_tokens_is_cut_there_and_drafts_stop_at_it(fake_sglang):
    """max_new_tokens=4: one token out, at most 4 - 1 - 1 = 2 draft tokens can be kept (the verify adds
    the bonus); the overshoot tick's run past the 4th token enters nothing."""
    assert patch.apply()
    w = make_worker(fake_sglang, overlap=True)
    d = patch.drafter_of(w)
    d.trees.insert("q", list(range(100, 120)))
    b = Batch([StopReq("a", [1], "q", max_new_tokens=4)], n=5)
    accepted_run(b, 0, [100])
    assert step(w, b) == [[101, 102]]
    b.reqs[0].output_ids.append(100)
    # a draft of 4 (as without the cap) accepted whole: output_ids would hold 6 tokens, SGLang keeps 4
    accepted_run(b, 0, [101, 102, 103, 104, 105])
    assert step(w, b) == [[]]
    assert d.trees.count("q", list(range(100, 104))) == 2 and d.trees.count("q", list(range(100, 105))) == 1
    stats = d.take_stats()
    assert stats["generated_tokens"] == 4 and stats["draft_tokens"] == 2


def test_drafts_stop_at_the_remaining_max_new_tokens_without_overlap(fake_sglang):
    assert patch.apply()
    w = make_worker(fake_sglang, draft_token_num=9)
    patch.drafter_of(w).trees.insert("q", list(range(100, 120)))
    b = Batch([StopReq("a", [1], "q", max_new_tokens=5), StopReq("b", [1], "q", max_new_tokens=1000)], n=9)
    for r in b.reqs:
        r.output_ids.extend([100, 101])
    assert step(w, b) == [[102, 103], list(range(102, 110))]


def test_stop_tokens_are_those_sglang_checks(fake_sglang):
    """Req._check_token_based_finish: sampling stop_token_ids, the request's eos_token_ids, the
    tokenizer's eos_token_id and additional_stop_token_ids; none of them under ignore_eos."""
    assert patch.apply()
    w = make_worker(fake_sglang)
    patch.drafter_of(w).trees.insert("q", [1, 2, 3, 4, 5, 6])
    tok = SimpleNamespace(eos_token_id=4, additional_stop_token_ids={5})
    reqs = [StopReq("stop", [9], "q", stop_token_ids={2}, eos_token_ids={3}, tokenizer=tok),
            StopReq("eos", [9], "q", eos_token_ids={3}, tokenizer=tok),
            StopReq("tok", [9], "q", tokenizer=tok),
            StopReq("extra", [9], "q", tokenizer=SimpleNamespace(eos_token_id=None, additional_stop_token_ids={5})),
            StopReq("ignore", [9], "q", stop_token_ids={2}, eos_token_ids={3}, tokenizer=tok, ignore_eos=True),
            StopReq("none", [9], "q")]
    for r in reqs:
        r.output_ids.append(1)
    assert step(w, Batch(reqs, n=5)) == [[2], [2, 3], [2, 3, 4], [2, 3, 4, 5], [2, 3, 4, 5], [2, 3, 4, 5]]


# ---- SGLang 0.5.23's NGRAM worker and a request's last verify step: its tokens reach the drafter once.



class MatchedToken(str):
    """FINISH_MATCHED_TOKEN (natural_stop in note_request_finished)."""


class FinalReq(StopReq):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.finished_len, self.to_finish = None, None

    def _stops(self):
        if self.sampling_params.ignore_eos:
            return set()
        out = set(self.sampling_params.stop_token_ids or ()) | set(self.eos_token_ids or ())
        if self.tokenizer is not None:
            out |= {self.tokenizer.eos_token_id, *(self.tokenizer.additional_stop_token_ids or ())}
        return out

    def update_finish_state(self, new_accepted_len=1):
        """Req.update_finish_state: to_finish, then stop tokens in the new run (finished_len at the first,
        capped at max_new_tokens), then the length."""
        if self.finished():
            return
        if self.to_finish:
            self.finished_reason, self.to_finish = self.to_finish, None
            return
        max_new = self.sampling_params.max_new_tokens
        new = list(self.output_ids[len(self.output_ids) - new_accepted_len:])
        for i, t in enumerate(new):
            if t in self._stops():
                self.finished_reason = MatchedToken("stop")
                self.finished_len = len(self.output_ids) - len(new) + i + 1
                if self.finished_len > max_new:
                    self.finished_reason, self.finished_len = "length", max_new
                return
        if len(self.output_ids) >= max_new:
            self.finished_reason, self.finished_len = "length", max_new

    def next_output_finishes_by_length(self):
        return len(self.output_ids) + 1 >= self.sampling_params.max_new_tokens

    @property
    def output_ids_through_stop(self):
        return self.output_ids if self.finished_len is None else self.output_ids[:self.finished_len]


class GrammarBatch(Batch):
    def grammar_needs_sync(self):
        return True


def process_decode_result(worker, batch, runs, overlap):
    """process_batch_result_decode for a spec batch: each request's accepted run (drafts + bonus)."""
    for req, run in zip(batch.reqs, runs):
        if overlap and (req.finished() or req.is_retracted):
            continue                          # the overshoot tick of a request finished last round
        req.output_ids.extend(run)
        req.update_finish_state(len(run))
        if req.finished():                    # _handle_finish_state_updated_req
            if hasattr(type(worker), "note_request_finished"):   # else BaseSpecWorker's no-op
                worker.note_request_finished(rid=req.rid,
                                             natural_stop=isinstance(req.finished_reason, MatchedToken))


def active(d):
    return d.trees.stats()["active_requests"]


def test_without_overlap_the_last_runs_tokens_enter_the_trees_up_to_the_stop(fake_sglang):
    """Sync scheduler: the last verify step accepts 2 3 EOS and a bonus past the EOS; the request is
    filtered out before the next batch. Its tokens through the EOS enter its prompt's tree and the
    shared tree, the bonus does not, the counters take the step, and its place is released at once."""
    assert patch.apply()
    w = make_worker(fake_sglang)
    d = patch.drafter_of(w)
    for _ in range(3):
        d.trees.insert("q", [1, 2, 3, 99, 5])
    a = FinalReq("a", [50, 51], "q", eos_token_ids={99})
    a.output_ids.append(1)                                    # the prefill's token
    b = Batch([a], n=5)
    first = step(w, b)
    assert first == [[2, 3, 99]]                              # drafts stop at the stop token
    run = greedy_verify(first[0], [2, 3, 99, 7, 8])
    assert run == [2, 3, 99, 7]                               # SGLang accepts the bonus past the EOS
    process_decode_result(w, b, [run], overlap=False)
    assert a.finished() and a.finished_len == 4
    assert d.trees.count("q", [1, 2, 3, 99]) == 4 and d.trees.count("q", [99, 7]) == 0
    assert d.trees.count(SHARED_KEY, [1, 2, 3, 99]) == 1 and d.trees.count(SHARED_KEY, [99, 7]) == 0
    assert active(d) == 0                                     # released without waiting for a next step
    stats = d.take_stats()
    assert stats["generated_tokens"] == 1 + 3 and stats["accepted_tokens"] == 3
    assert stats["request_steps"] == 2 and stats["draft_tokens"] == 3
    step(w, Batch([FinalReq("other", [3])], n=5))                  # the next batch: nothing more of a
    assert d.trees.count("q", [1, 2, 3, 99]) == 4 and d.take_stats()["generated_tokens"] == 0


def test_without_overlap_a_run_past_max_new_tokens_enters_up_to_it(fake_sglang):
    """max_new_tokens=4 and a run that crosses it (the draft was cut to what is left: 4 - 1 - 1 = 2, the
    verify adds the bonus): the request's 4 tokens enter, nothing past them."""
    assert patch.apply()
    w = make_worker(fake_sglang)
    d = patch.drafter_of(w)
    d.trees.insert("q", list(range(100, 120)))
    a = FinalReq("a", [1], "q", max_new_tokens=4)
    a.output_ids.append(100)
    b = Batch([a], n=5)
    assert step(w, b) == [[101, 102]]
    process_decode_result(w, b, [[101, 102, 103, 104]], overlap=False)   # as if SGLang ran past it
    assert a.finished() and a.finished_len == 4
    assert d.trees.count("q", [100, 101, 102, 103]) == 2 and d.trees.count("q", [103, 104]) == 1
    stats = d.take_stats()
    assert stats["generated_tokens"] == 4 and stats["accepted_tokens"] == 2 and active(d) == 0


def test_with_overlap_the_last_run_counts_once_and_the_place_is_released(fake_sglang):
    """Overlap scheduler: the drafter took step N's run (stop included, past it cut) when it prepared
    step N+1, which still holds the request; processing step N then finishes it. Nothing enters twice,
    and its place is released then, not a step later."""
    assert patch.apply()
    w = make_worker(fake_sglang, overlap=True)
    d = patch.drafter_of(w)
    for _ in range(3):
        d.trees.insert("q", [1, 2, 99, 5, 6, 7])
    a, c = FinalReq("a", [50, 51], "q", eos_token_ids={99}), FinalReq("c", [50, 51], "q")
    b = Batch([a, c], n=5)
    accepted_run(b, 0, [1])                                   # the prefill's tokens, not yet in output_ids
    accepted_run(b, 1, [1])
    assert step(w, b) == [[2, 99], [2, 99, 5, 6]]             # step N's drafts (c has no stop token)
    for r in (a, c):
        r.output_ids.append(1)                                # the prefill's result processed
    runs = [greedy_verify([2, 99], [2, 99, 5, 6]), greedy_verify([2, 99, 5, 6], [2, 3, 4, 5, 6])]
    assert runs == [[2, 99, 5], [2, 3]]
    accepted_run(b, 0, runs[0])
    accepted_run(b, 1, runs[1])
    assert step(w, b)[0] == []                                # step N+1 (a's overshoot tick) launched
    process_decode_result(w, b, runs, overlap=True)           # step N's result: a finishes
    assert a.finished() and not c.finished()
    assert d.trees.count("q", [1, 2, 99]) == 4 and d.trees.count("q", [99, 5]) == 3
    assert active(d) == 2                                     # c only, in its prompt's and the shared tree
    process_decode_result(w, b, [[7], [4]], overlap=True)     # step N+1's result: a's row skipped
    step(w, Batch([c], n=5))
    assert d.trees.count("q", [1, 2, 99]) == 4 and d.trees.count("q", [99, 5]) == 3
    stats = d.take_stats()
    assert stats["generated_tokens"] == 2 * 1 + 2 + 2 + 1 and stats["accepted_tokens"] == 2 + 1


def test_with_overlap_a_request_left_out_of_the_next_step_is_held_for_its_last_token(fake_sglang):
    """Overlap scheduler: a request whose next token reaches max_new_tokens is left out of step N+1
    (`_reqs_finishing_inflight`), so the drafter does not see it when it prepares that step; its step-N
    token arrives when step N's result finishes it."""
    assert patch.apply()
    w = make_worker(fake_sglang, overlap=True)
    d = patch.drafter_of(w)
    d.trees.insert("q", list(range(100, 120)))
    a, c = FinalReq("a", [1], "q", max_new_tokens=2), FinalReq("c", [1], "q")
    bn = Batch([a, c], n=5)
    accepted_run(bn, 0, [100])
    accepted_run(bn, 1, [100])
    assert step(w, bn) == [[], [101, 102, 103, 104]]          # a has one token left: no draft
    for r in (a, c):
        r.output_ids.append(100)
    assert a.next_output_finishes_by_length()                 # left out of step N+1
    bn1 = Batch([c], n=5)
    accepted_run(bn1, 0, [101, 102, 103, 104, 105])
    step(w, bn1)
    assert active(d) == 4                                     # a waits for its result: still held
    process_decode_result(w, bn, [[101], [101, 102, 103, 104, 105]], overlap=True)
    assert a.finished() and a.finished_len == 2
    assert d.trees.count("q", [100, 101]) == 3 and active(d) == 2
    stats = d.take_stats()
    assert stats["generated_tokens"] == (1 + 1) + (1 + 5) and stats["accepted_tokens"] == 4


def test_a_request_finished_before_its_batch_is_drafted_is_not_started_again(fake_sglang):
    """Overlap disabled for a batch (grammar sync): step N's result is processed after step N+1 was
    built, so the request it finishes is in step N+1's batch; its tokens arrived when it finished and
    must not enter again (its place was released: it would start over with its whole response)."""
    assert patch.apply()
    w = make_worker(fake_sglang, overlap=True)
    d = patch.drafter_of(w)
    d.trees.insert("q", [1, 2, 99, 5])
    a, c = FinalReq("a", [50], "q", eos_token_ids={99}), FinalReq("c", [50], "q")
    for r in (a, c):
        r.output_ids.append(1)
    b = GrammarBatch([a, c], n=5)
    assert step(w, b) == [[2, 99], [2, 99, 5]]
    process_decode_result(w, b, [[2, 99, 5], [2, 3]], overlap=True)
    assert a.finished() and d.trees.count("q", [1, 2, 99]) == 2
    generated = d.take_stats()["generated_tokens"]
    assert generated == 1 + 2 + 1                             # a's last run (through 99) and c's first token
    assert step(w, b)[0] == []                                # a is in the batch once more: no draft
    assert d.trees.count("q", [1, 2, 99]) == 2 and d.trees.count("q", [1]) == 3
    assert d.take_stats()["generated_tokens"] == 2 and active(d) == 2   # c's run only; c alone is live


def test_a_request_ended_otherwise_drafts_nothing_at_its_end(fake_sglang):
    """An abort (`to_finish`) ends a request with no stop token and room left: its last run enters,
    and no draft is made or counted for it."""
    assert patch.apply()
    w = make_worker(fake_sglang)
    d = patch.drafter_of(w)
    for _ in range(2):
        d.trees.insert("q", [1, 2, 3, 4, 5, 6, 7])
    a = FinalReq("a", [50], "q")
    a.output_ids.append(1)
    b = Batch([a], n=5)
    assert step(w, b) == [[2, 3, 4, 5]]
    a.to_finish = "abort"
    process_decode_result(w, b, [[2, 3, 9]], overlap=False)
    assert a.finished() and d.trees.count("q", [1, 2, 3, 9]) == 1 and active(d) == 0
    stats = d.take_stats()
    assert stats["draft_tokens"] == 4 and stats["accepted_tokens"] == 2 and stats["generated_tokens"] == 4


def test_the_hook_is_pinned_reversible_and_quiet_for_others(fake_sglang):
    """note_request_finished is the patched method (added to NGRAMWorker, removed on revert); it does
    nothing for requests that did not opt in, that the drafter never saw, or before any draft."""
    W = fake_sglang.NGRAMWorker
    assert patch.apply()
    assert W.note_request_finished is patch.note_request_finished
    w = make_worker(fake_sglang)
    w.note_request_finished(rid="never", natural_stop=True)
    assert "specrl_drafter" not in w.__dict__                 # no drafter made for it
    d = patch.drafter_of(w)
    plain = FinalReq("plain", [50], custom={"other": 1})
    plain.output_ids.append(1)
    b = Batch([plain], n=5)
    assert step(w, b) == [[]]
    process_decode_result(w, b, [[2]], overlap=False)
    plain.finished_reason = "length"
    w.note_request_finished(rid="plain", natural_stop=False)
    w.note_request_finished(rid="unknown", natural_stop=False)
    assert d.take_stats()["generated_tokens"] == 0 and d.trees.stats()["keys"] == 0
    patch.revert()
    assert not hasattr(W, "note_request_finished")


# ---- SGLang 0.5.23's NGRAM worker and a request that finishes in its prefill: its response reaches the trees once.


EXTEND = SimpleNamespace(is_decode=lambda: False, is_extend=lambda: True)
DECODE = SimpleNamespace(is_decode=lambda: True, is_extend=lambda: False)


class Prefill:
    def __init__(self, reqs):
        self.reqs, self.forward_mode = reqs, EXTEND


class Decode(Batch):
    forward_mode = DECODE


class GrammarDecode(Decode):
    def grammar_needs_sync(self):
        return True


def process_prefill_result(batch, tokens):
    """process_batch_result_prefill for whole prefills: None is a discarded output (`to_finish`)."""
    for req, tok in zip(batch.reqs, tokens):
        if req.finished() or req.is_retracted:
            continue
        if tok is None:
            req.to_finish = "abort"
            req.update_finish_state(0)
            continue
        req.output_ids.append(tok)
        req.update_finish_state()


def sglang_process_batch_result(self, batch, result):
    """Scheduler.process_batch_result's dispatch."""
    if batch.forward_mode.is_decode():
        process_decode_result(self.draft_worker, batch, result, overlap=self.draft_worker.enable_overlap)
    elif batch.forward_mode.is_extend():
        process_prefill_result(batch, result)


@pytest.fixture
def scheduler(fake_sglang, monkeypatch):
    """A patched fake scheduler whose process_batch_result is SGLang's dispatch; sync by default."""
    monkeypatch.setattr(fake_sglang.Scheduler, "process_batch_result", sglang_process_batch_result, raising=False)
    assert patch.apply()

    def make(overlap=False):
        s = fake_sglang.Scheduler()
        s.draft_worker = make_worker(fake_sglang, overlap=overlap)
        return s
    return make


def no_state(d):
    return not d._live and not d._own and not d._unverified and active(d) == 0


def test_a_stop_token_first_or_max_new_tokens_reached_enters_the_trees_once(scheduler):
    """Sync scheduler: a stop token first and max_new_tokens=1 finish their requests in the prefill; their
    tokens enter the prompt's and the shared tree, as one request step each, and no place is kept. The
    first requests ever to finish so create the drafter; one without a draft key, and one whose output
    SGLang discarded, enter nothing. A request that goes on to decode and finishes there is not
    entered twice (note_request_finished takes it, the prefill hook does not)."""
    s = scheduler()
    w = s.draft_worker
    a = FinalReq("a", [50, 51], "q", eos_token_ids={99})
    b = FinalReq("b", [50, 51], "q", max_new_tokens=1)
    plain = FinalReq("plain", [50, 51], custom={"other": 1}, max_new_tokens=1)
    gone = FinalReq("gone", [50, 51], "q")
    c = FinalReq("c", [50, 51], "q", eos_token_ids={99})
    s.process_batch_result(Prefill([a, b, plain, gone, c]), [99, 7, 7, None, 7])
    assert a.finished() and b.finished() and plain.finished() and gone.finished() and not c.finished()
    assert "specrl_drafter" in w.__dict__
    d = patch.drafter_of(w)
    assert d.trees.count("q", [99]) == 1 and d.trees.count(SHARED_KEY, [99]) == 1
    assert d.trees.count("q", [7]) == 1 and d.trees.count(SHARED_KEY, [7]) == 1   # b only (c: not yet)
    assert d.trees.stats()["sequences"] == 4                  # a and b, each in two trees
    assert no_state(d)
    stats = d.take_stats()
    assert stats["generated_tokens"] == 2 and stats["request_steps"] == 2
    assert stats["accepted_tokens"] == 0 and stats["draft_tokens"] == 0 and stats["proposed_tokens"] == 0
    assert stats["engine_steps"] == 0                         # no decode step ran
    bc = Decode([c], n=5)
    step(w, bc)                                               # c decodes; a and b are in no batch
    s.process_batch_result(bc, [[99]])                        # c finishes in decode
    assert c.finished() and d.trees.count("q", [7]) == 2 and d.trees.count("q", [7, 99]) == 1
    assert d.trees.count("q", [99]) == 2 and no_state(d)
    stats = d.take_stats()
    assert stats["generated_tokens"] == 2 and stats["request_steps"] == 2


def test_an_extension_whose_prefix_is_the_whole_old_response_feeds_later_drafts(scheduler):
    """exact / lenient: the extension's prompt ends with last epoch's whole response (1 2 3 4, accepted)
    and one token is left (max_new_tokens=1): its prefill samples 5 and ends it. Its response, prefix
    and token, enters the prompt's and the shared tree; a later request of the prompt drafts through
    it. Only the new token counts as generated; a lenient extension ending at a stop token enters too."""
    s = scheduler()
    w = s.draft_worker
    d = patch.drafter_of(w)
    d.trees.insert("q", [1, 2, 3, 4])                         # last epoch's response
    d.trees.insert(SHARED_KEY, [1, 2, 3, 4])
    ext = FinalReq("ext", [50, 51, 1, 2, 3, 4], "q", response_start=2, max_new_tokens=1)
    stop = FinalReq("stop", [50, 51, 1, 2], "q", response_start=2, eos_token_ids={99})
    s.process_batch_result(Prefill([ext, stop]), [5, 99])
    assert ext.finished() and stop.finished()
    assert d.trees.count("q", [1, 2, 3, 4, 5]) == 1 and d.trees.count(SHARED_KEY, [1, 2, 3, 4, 5]) == 1
    assert d.trees.count("q", [1, 2, 3, 4]) == 2 and d.trees.count("q", [1, 2, 99]) == 1
    assert no_state(d)
    stats = d.take_stats()
    assert stats["generated_tokens"] == 2 and stats["request_steps"] == 2
    later = FinalReq("later", [50, 51], "q")
    later.output_ids.append(1)
    assert step(w, Decode([later], n=5)) == [[2, 3, 4, 5]]   # 5 after 4: only the extension saw it


def test_under_overlap_a_request_drafted_before_its_prefill_result_counts_once_and_is_released(scheduler):
    """Overlap scheduler: the prefill's requests join the next decode step before its result is
    processed. a (a stop token first) is in that step, its token read from spec_info; b
    (max_new_tokens=1) is left out of it (`_reqs_finishing_inflight`). Processing the prefill's result
    finishes both: a's token is not entered again and its place is released then, b's enters; the
    decode step's result skips a, and later steps add nothing of either."""
    s = scheduler(overlap=True)
    w = s.draft_worker
    d = patch.drafter_of(w)
    d.trees.insert("q", [1, 2, 3])
    a = FinalReq("a", [50, 51], "q", eos_token_ids={99})
    b = FinalReq("b", [50, 51], "q", max_new_tokens=1)
    c = FinalReq("c", [50, 51], "q")
    prefill = Prefill([a, b, c])                              # launched; its result is not processed yet
    assert b.next_output_finishes_by_length()                 # left out of the next decode step
    n1 = Decode([a, c], n=5)
    accepted_run(n1, 0, [99])
    accepted_run(n1, 1, [1])
    assert step(w, n1) == [[], [2, 3]]                        # a ended at its stop token: no draft
    assert active(d) == 4
    s.process_batch_result(prefill, [99, 7, 1])               # the prefill's result
    assert a.finished() and b.finished() and not c.finished()
    assert d.trees.count("q", [99]) == 1 and d.trees.count(SHARED_KEY, [99]) == 1
    assert d.trees.count("q", [7]) == 1 and d.trees.count(SHARED_KEY, [7]) == 1
    assert active(d) == 2 and set(d._live) == {"c"}          # c only, in its prompt's and the shared tree
    s.process_batch_result(n1, [[99, 5], [2, 3, 4]])          # the decode step's result: a's row skipped
    n2 = Decode([c], n=5)                                     # (its own run already processed here)
    step(w, n2)
    assert d.trees.count("q", [99]) == 1 and d.trees.count("q", [7]) == 1
    stats = d.take_stats()
    assert stats["generated_tokens"] == 1 + 1 + 1 + 3 and stats["request_steps"] == 4
    assert stats["accepted_tokens"] == 2


def test_a_prefill_result_processed_before_the_next_step_is_drafted_is_not_started_again(scheduler):
    """Overlap disabled for a batch (a grammar sync): the prefill's result is processed after the next
    decode batch was built, so the request it finished is in that batch; it entered once, when it
    finished, and is neither entered again nor given a place."""
    s = scheduler(overlap=True)
    w = s.draft_worker
    a = FinalReq("a", [50, 51], "q", eos_token_ids={99})
    c = FinalReq("c", [50, 51], "q")
    prefill = Prefill([a, c])
    s.process_batch_result(prefill, [99, 1])
    d = patch.drafter_of(w)
    assert d.trees.count("q", [99]) == 1 and no_state(d)
    assert step(w, GrammarDecode([a, c], n=5))[0] == []
    assert d.trees.count("q", [99]) == 1 and set(d._live) == {"c"}
    stats = d.take_stats()
    assert stats["generated_tokens"] == 2 and stats["request_steps"] == 2


def test_a_retracted_request_finishing_in_its_new_prefill_enters_its_last_tokens_once(scheduler):
    """A request retracted under decode-memory pressure keeps its output_ids and its place in the
    drafter; prefilled again (is_retracted cleared), its prefill's token may finish it: the run the
    drafter had not yet seen and that token enter, nothing twice, and its place is released."""
    s = scheduler()
    w = s.draft_worker
    d = patch.drafter_of(w)
    a, c = FinalReq("a", [50], "q", eos_token_ids={99}), FinalReq("c", [50], "q")
    a.output_ids.append(1)
    c.output_ids.append(1)
    b = Decode([a, c], n=5)
    step(w, b)
    s.process_batch_result(b, [[2, 3], [2]])                  # a's run 2 3: not yet seen by the drafter
    a.is_retracted = True                                     # retracted: back to the waiting queue
    step(w, Decode([c], n=5))
    assert active(d) == 4                                     # a's place is kept
    a.is_retracted = False                                    # prepare_for_extend of its new prefill
    s.process_batch_result(Prefill([a]), [99])
    assert a.finished() and d.trees.count("q", [1, 2, 3, 99]) == 1 and d.trees.count("q", [1, 2, 3]) == 1
    assert active(d) == 2 and set(d._live) == {"c"}
    stats = d.take_stats()
    assert stats["generated_tokens"] == 1 + 1 + 1 + 3 and stats["request_steps"] == 2 + 1 + 1


def test_the_wrapper_is_pinned_and_reversible(scheduler, fake_sglang):
    """Scheduler.process_batch_result is wrapped while the patch is applied and SGLang's own after revert;
    a scheduler without our NGRAM worker (no speculative decoding) is passed straight through."""
    S = fake_sglang.Scheduler
    assert S.process_batch_result is patch.process_batch_result
    plain = S()
    plain.draft_worker = None
    r = FinalReq("r", [1], "q", max_new_tokens=1)
    plain.process_batch_result(Prefill([r]), [5])
    assert r.finished() and list(r.output_ids) == [5]
    patch.revert()
    assert S.process_batch_result is sglang_process_batch_result
