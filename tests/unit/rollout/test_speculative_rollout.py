"""Verify -> accept -> extend on scripted engines: every branch of the orchestration.

Review of the speculative rollout core (rollout/speculative.py and the step around it).
"""

import math
import pytest
import torch
from megatron_specrl.engines.protocol import (
    EngineCapabilities, GenerateResult, SamplingSettings, ScoreResult, WeightVersionMismatch,
)
from megatron_specrl.rollout.batch import build_batch
from megatron_specrl.rollout.speculative import SpeculativeRollout
from megatron_specrl.rollout.store import Trajectory, TrajectoryStore
from tests.helpers.capabilities import DraftsNothing



# ---- Verify -> accept -> extend on scripted engines: every branch of the orchestration.

EOS, PAD = 1, 0
SURE, NEVER = 0.0, math.log(1e-12)   # log-probs that make acceptance certain / impossible


class ScriptedEngine(EngineCapabilities):
    """Score returns the scripted log-probs; generate returns tokens 50, 51, ... then EOS."""

    name = "scripted"

    def __init__(self, new_logprobs, version=1, continuation=3):
        self.new_logprobs, self._version, self.continuation = new_logprobs, version, continuation
        self.score_requests, self.generate_requests = [], []

    @property
    def weight_version(self):
        return self._version

    def score(self, requests, sampling, weight_version):
        if weight_version != self._version:
            raise WeightVersionMismatch("stale")
        self.score_requests += requests
        return [ScoreResult(self.new_logprobs(r.continuation_ids), self._version) for r in requests]

    def generate(self, requests, sampling, weight_version):
        if weight_version != self._version:
            raise WeightVersionMismatch("stale")
        self.generate_requests += requests
        out = []
        for r in requests:
            toks = [50 + i for i in range(self.continuation)] + [EOS]
            finish = "stop"
            if len(toks) > r.max_new_tokens:
                toks, finish = toks[: r.max_new_tokens], "length"
            out.append(GenerateResult(toks, [-0.5] * len(toks), finish, 0, self._version))
        return out


def _roll(engine, store, mode="exact", L=8, lenience=1.0):
    return SpeculativeRollout(engine, store, mode=mode, lenience=lenience, sampling=SamplingSettings(),
                              max_new_tokens=L, seed=0)


def _store_with(draft, finish="stop", version=0, q=-0.1):
    store = TrajectoryStore()
    store.put("p0", 0, Trajectory(list(draft), [q] * len(draft), finish, version))
    return store


def test_empty_store_is_plain_generation():
    engine = ScriptedEngine(lambda ids: [SURE] * len(ids))
    samples, m = _roll(engine, TrajectoryStore()).run([("p0", [5, 6])], 2, 1, step=0)
    assert engine.score_requests == [] and len(engine.generate_requests) == 2
    assert all(r.prompt_ids == [5, 6] and r.max_new_tokens == 8 and r.ban_first_token is None
               for r in engine.generate_requests)
    assert samples[0].response_ids == [50, 51, 52, EOS] and samples[0].num_reused == 0
    assert m["spec/reuse_ratio"] == 0.0


def test_rejection_at_first_token_bans_it_in_exact_mode():
    engine = ScriptedEngine(lambda ids: [NEVER] + [SURE] * (len(ids) - 1))
    samples, m = _roll(engine, _store_with([9, 10, EOS])).run([("p0", [5])], 1, 1, step=0)
    (req,) = engine.generate_requests
    assert req.prompt_ids == [5] and req.max_new_tokens == 8 and req.ban_first_token == 9
    assert samples[0].num_reused == 0 and m["spec/accepted_tokens"] == 0


def test_rejection_in_the_middle_extends_from_there():
    engine = ScriptedEngine(lambda ids: [SURE, SURE, SURE, NEVER, SURE, SURE][: len(ids)])
    store = _store_with([9, 10, 11, 12, 13, EOS])
    samples, m = _roll(engine, store).run([("p0", [5])], 1, 1, step=3)
    (req,) = engine.generate_requests
    assert req.prompt_ids == [5, 9, 10, 11] and req.max_new_tokens == 5 and req.ban_first_token == 12
    s = samples[0]
    assert s.response_ids == [9, 10, 11, 50, 51, 52, EOS] and s.num_reused == 3
    assert s.logprobs == [SURE] * 3 + [-0.5] * 4        # current-policy log-probs for every token
    assert store.get("p0", 0).token_ids == s.response_ids and store.get("p0", 0).weight_version == 1
    assert m["spec/mean_accept_len"] == 3


class ReplacingEngine(ScriptedEngine):
    """Also returns a replacement per position (as the vLLM engine does): token 40 + t, or the
    scripted `replacements` list (-1 = none), with processed log-prob -0.7."""

    verifies_processed_distribution = True

    def __init__(self, new_logprobs, replacements=None, **kw):
        super().__init__(new_logprobs, **kw)
        self.replacements = replacements

    def score(self, requests, sampling, weight_version):
        out = super().score(requests, sampling, weight_version)
        for r, res in zip(requests, out):
            n = len(r.continuation_ids)
            reps = self.replacements or [40 + t for t in range(n)]
            res.sample_logprobs = list(res.logprobs)
            res.logprobs = [v - 0.01 for v in res.logprobs]     # tempered != processed: must not be stored
            res.replacements = reps[:n]
            res.replacement_logprobs = [-0.8] * n
            res.replacement_sample_logprobs = [-0.7] * n
            res.replacement_stops = [tok == EOS for tok in reps[:n]]
        return out


def test_exact_takes_the_replacement_as_the_first_new_token():
    engine = ReplacingEngine(lambda ids: [SURE, SURE, NEVER, SURE, SURE][: len(ids)])
    store = _store_with([9, 10, 11, 12, EOS])
    samples, m = _roll(engine, store).run([("p0", [5])], 1, 1, step=0)
    (req,) = engine.generate_requests
    assert req.prompt_ids == [5, 9, 10, 42] and req.max_new_tokens == 5 and req.ban_first_token is None
    s = samples[0]
    assert s.response_ids == [9, 10, 42, 50, 51, 52, EOS] and s.num_reused == 2
    assert s.logprobs == [SURE, SURE, -0.7, -0.5, -0.5, -0.5, -0.5]   # processed log-probs throughout
    assert store.get("p0", 0).logprobs == s.logprobs
    assert m["spec/replaced_tokens"] == 1 and m["spec/accepted_tokens"] == 2


def test_exact_replacement_at_the_last_position_or_eos_needs_no_generation():
    L = 4
    engine = ReplacingEngine(lambda ids: [SURE, SURE, SURE, NEVER][: len(ids)])
    samples, _ = _roll(engine, _store_with([9, 10, 11, 12], finish="length"), L=L).run([("p0", [5])], 1, 1, 0)
    assert engine.generate_requests == []                        # n = L - 1: r_n is the last token
    assert samples[0].response_ids == [9, 10, 11, 43] and samples[0].finish_reason == "length"

    engine = ReplacingEngine(lambda ids: [SURE, NEVER, SURE][: len(ids)], replacements=[40, EOS, 41])
    store = _store_with([9, 10, EOS])
    samples, _ = _roll(engine, store).run([("p0", [5])], 1, 1, 0)
    assert engine.generate_requests == []                        # r_n = EOS ends the response
    assert samples[0].response_ids == [9, EOS] and samples[0].finish_reason == "stop"
    assert store.get("p0", 0).finish_reason == "stop" and store.get("p0", 0).logprobs == [SURE, -0.7]


def test_a_response_ended_by_a_replacement_is_not_full_reuse():
    """spec/full_reuse_ratio counts samples that are their whole draft; one that a replacement ended
    (EOS, or the L-th token) needed no extension either, but its last token is new (it was counted)."""
    engine = ReplacingEngine(lambda ids: [NEVER, SURE, SURE][: len(ids)], replacements=[EOS, 40, 41])
    samples, m = _roll(engine, _store_with([9, 10, EOS])).run([("p0", [5])], 1, 1, 0)
    assert engine.generate_requests == [] and samples[0].response_ids == [EOS] and samples[0].num_reused == 0
    assert m["spec/full_reuse_ratio"] == 0.0 and m["spec/reuse_ratio"] == 0.0
    engine = ReplacingEngine(lambda ids: [SURE, SURE, NEVER][: len(ids)])
    samples, m = _roll(engine, _store_with([9, 10, 11], finish="length"), L=3).run([("p0", [5])], 1, 1, 0)
    assert engine.generate_requests == [] and samples[0].response_ids == [9, 10, 42]
    assert m["spec/full_reuse_ratio"] == 0.0


def test_exact_without_a_replacement_extends_from_the_rejected_position():
    """-1: the processed distribution is a point mass on y_n (rejected by rounding only)."""
    engine = ReplacingEngine(lambda ids: [SURE, NEVER, SURE][: len(ids)], replacements=[-1, -1, -1])
    samples, m = _roll(engine, _store_with([9, 10, EOS])).run([("p0", [5])], 1, 1, 0)
    (req,) = engine.generate_requests
    assert req.prompt_ids == [5, 9] and req.max_new_tokens == 7 and req.ban_first_token is None
    assert m["spec/replaced_tokens"] == 0


def test_lenient_resamples_from_the_full_distribution():
    engine = ReplacingEngine(lambda ids: [SURE, NEVER, SURE][: len(ids)])
    _roll(engine, _store_with([9, 10, EOS]), mode="lenient", lenience=math.exp(0.5)).run([("p0", [5])], 1, 1, 0)
    (req,) = engine.generate_requests
    assert req.ban_first_token is None and req.prompt_ids == [5, 9]   # no replacement either


def test_full_acceptance_with_eos_generates_nothing():
    engine = ScriptedEngine(lambda ids: [SURE] * len(ids))
    samples, m = _roll(engine, _store_with([9, 10, EOS])).run([("p0", [5])], 1, 1, step=0)
    assert engine.generate_requests == []
    assert samples[0].response_ids == [9, 10, EOS] and samples[0].finish_reason == "stop"
    assert m["spec/full_reuse_ratio"] == 1.0 and m["spec/reuse_ratio"] == 1.0


def test_full_acceptance_without_eos_continues_the_draft():
    engine = ScriptedEngine(lambda ids: [SURE] * len(ids))
    samples, _ = _roll(engine, _store_with([9, 10, 11], finish="length"), L=8).run([("p0", [5])], 1, 1, 0)
    (req,) = engine.generate_requests
    assert req.prompt_ids == [5, 9, 10, 11] and req.max_new_tokens == 5 and req.ban_first_token is None
    assert samples[0].response_ids == [9, 10, 11, 50, 51, 52, EOS]


def test_old_response_longer_than_L_is_truncated_and_finishes_by_length():
    engine = ScriptedEngine(lambda ids: [SURE] * len(ids))
    samples, _ = _roll(engine, _store_with([9, 10, 11, 12, 13, 14, EOS]), L=4).run([("p0", [5])], 1, 1, 0)
    assert len(engine.score_requests[0].continuation_ids) == 4
    assert engine.generate_requests == []
    assert samples[0].response_ids == [9, 10, 11, 12] and samples[0].finish_reason == "length"


def test_entry_from_an_older_version_is_verified_under_current_weights():
    engine = ScriptedEngine(lambda ids: [-0.2] * len(ids), version=7)
    store = _store_with([9, 10, EOS], version=2, q=-0.2)
    samples, _ = _roll(engine, store, mode="lenient").run([("p0", [5])], 1, 7, step=0)
    assert engine.score_requests, "an old entry must still be verified, not trusted"
    assert samples[0].weight_version == 7 and store.get("p0", 0).weight_version == 7
    with pytest.raises(WeightVersionMismatch):
        _roll(engine, store).run([("p0", [5])], 1, 6, step=1)


def test_off_mode_ignores_the_store():
    engine = ScriptedEngine(lambda ids: [SURE] * len(ids))
    _roll(engine, _store_with([9, EOS]), mode="off").run([("p0", [5])], 1, 1, 0)
    assert engine.score_requests == [] and len(engine.generate_requests) == 1


@pytest.mark.parametrize("pad_id", [PAD, EOS])
def test_batch_masks_eos_but_not_padding(pad_id):
    engine = ScriptedEngine(lambda ids: [SURE] * len(ids), continuation=1)
    store = _store_with([9, 10, 11, 12, EOS])
    samples, _ = _roll(engine, store).run([("p0", [5, 6])], 1, 1, 0)
    short = ScriptedEngine(lambda ids: [SURE] * len(ids), continuation=0)
    samples += _roll(short, TrajectoryStore()).run([("p1", [7])], 1, 1, 0)[0]
    batch = build_batch(samples, torch.tensor([1.0, -1.0]), pad_id=pad_id)
    assert batch["input_ids"].shape == (2, 7)
    assert batch["loss_mask"][0].tolist() == [0, 0, 1, 1, 1, 1, 1]       # response incl. EOS
    assert batch["loss_mask"][1].tolist() == [0, 1, 0, 0, 0, 0, 0]       # just EOS, then padding
    assert batch["input_ids"][1].tolist() == [7, EOS] + [pad_id] * 5
    assert batch["advantages"][1].tolist() == [0, -1, 0, 0, 0, 0, 0]


def test_store_round_trip_and_corruption(tmp_path):
    store = TrajectoryStore()
    store.put("a", 0, Trajectory([1, 2, 3], [-0.1, -0.2, -0.3], "stop", 3))
    store.put("b", 1, Trajectory([], [], "length", 4))
    store.save(tmp_path)
    back = TrajectoryStore.load(tmp_path)
    assert back.get("a", 0).token_ids == [1, 2, 3] and back.get("a", 0).weight_version == 3
    assert back.get("a", 0).logprobs == pytest.approx([-0.1, -0.2, -0.3])
    assert back.get("b", 1).token_ids == [] and len(back) == 2
    (tmp_path / "trajectories.npz").write_bytes(b"garbage")
    with pytest.raises(RuntimeError, match="corrupt"):
        TrajectoryStore.load(tmp_path)


def test_wrappers_forward_the_verification_capability():
    """RayEngine reads it from the engine class (no actor call); a router needs it from every engine."""
    from megatron_specrl.engines.protocol import verifies_processed_distribution
    from megatron_specrl.engines.ray_engine import RayEngine
    from megatron_specrl.engines.router import EngineRouter
    from megatron_specrl.engines.sglang import SGLangEngine
    from megatron_specrl.engines.vllm import VLLMEngine

    def ray_of(cls):
        eng = object.__new__(RayEngine)   # no actor: the property must not need one
        eng.engine_cls = cls
        return eng

    vllm, sgl = ray_of(VLLMEngine), ray_of(SGLangEngine)
    assert verifies_processed_distribution(vllm) and not verifies_processed_distribution(sgl)
    assert EngineRouter([vllm, vllm]).verifies_processed_distribution
    assert not EngineRouter([vllm, sgl]).verifies_processed_distribution
    assert not verifies_processed_distribution(ScriptedEngine(lambda ids: []))
    with pytest.raises(NotImplementedError, match="cannot verify"):
        SpeculativeRollout(EngineRouter([vllm, sgl]), TrajectoryStore(), mode="exact", lenience=1.0,
                           sampling=SamplingSettings(top_p=0.9), max_new_tokens=4, seed=0)


class TreeScriptedEngine(ScriptedEngine, DraftsNothing):
    """A scripted engine that declares tree drafting (and keeps no trees)."""


def test_runahead_requests_go_to_the_engine_only():
    """Up to `runahead` requests for the next step's prompts (sample 0 of each, then sample 1)
    join the generation batch, flagged; their results are neither samples nor stored."""
    engine = TreeScriptedEngine(lambda ids: [SURE] * len(ids))   # run-ahead requests feed draft trees
    store = TrajectoryStore()
    roll = SpeculativeRollout(engine, store, mode="exact", lenience=1.0, sampling=SamplingSettings(),
                              max_new_tokens=8, seed=0, runahead=3, verify="prefill")
    samples, m = roll.run([("p0", [5, 6])], 2, 1, step=0, next_prompts=[("n0", [7]), ("n1", [8, 9])])
    ahead = [r for r in engine.generate_requests if r.runahead]
    assert [(r.draft_key, r.prompt_ids) for r in ahead] == [("n0", [7]), ("n1", [8, 9]), ("n0", [7])]
    assert len({r.seed for r in ahead}) == 3 and all(r.response_start == len(r.prompt_ids) for r in ahead)
    assert [s.prompt_id for s in samples] == ["p0", "p0"] and len(store) == 2
    assert m["runahead/requests"] == 3
    engine.generate_requests.clear()
    roll.run([("p0", [5, 6])], 2, 1, step=1)            # no next prompts: nothing runs ahead
    assert not any(r.runahead for r in engine.generate_requests)


def test_router_verifies_a_prompt_on_the_engine_that_extends_it():
    """Through a router, a (prompt, sample)'s verification must run on the engine that then extends
    it (its prefix cache holds the prompt and the accepted prefix), and a prompt's samples on one
    engine (a verification reads the prompt blocks a sibling computed). Balanced by cost, the two
    equal-cost samples of a prompt were split over the engines."""
    from megatron_specrl.engines.router import EngineRouter

    engines = [ReplacingEngine(lambda ids: [SURE, NEVER, SURE, SURE][: len(ids)]) for _ in range(2)]
    for e in engines:
        e.draft_stats = dict
    store = TrajectoryStore()
    prompts = [(f"p{i}", [5] * (i + 1)) for i in range(6)]
    for pid, _ in prompts:
        for k in range(2):
            store.put(pid, k, Trajectory([9, 10, 11, EOS], [-0.1] * 4, "stop", 0))
    _roll(EngineRouter(engines), store).run(prompts, 2, 1, step=0)
    scored = {len(r.prompt_ids): i for i, e in enumerate(engines) for r in e.score_requests}
    extended = {len(r.prompt_ids) - 2: i for i, e in enumerate(engines) for r in e.generate_requests}
    assert sum(len(e.score_requests) for e in engines) == 12 and len(scored) == 6
    for i, e in enumerate(engines):   # every sample of a prompt scored on one engine
        for r in e.score_requests:
            assert scored[len(r.prompt_ids)] == i
    assert scored == extended


# ---- Review of the speculative rollout core (rollout/speculative.py and the step around it).

EOS = 1


class OwnDraftEngine(DraftsNothing):
    """rollout.verify=decode stand-in: every request's response is its own draft, accepted whole
    (as the engine's rejection sampler does when every drafted token passes), then tokens 50, 51, ...
    up to EOS or max_new_tokens."""

    name = "own-draft"
    weight_version = 1

    def __init__(self, tail=(50, 51, EOS)):
        self.tail = list(tail)

    def generate(self, requests, sampling, weight_version):
        out = []
        for r in requests:
            draft = list(r.own_draft or [])
            toks = draft if draft and draft[-1] == EOS else draft + self.tail
            finish = "stop" if toks[-1] == EOS and len(toks) <= r.max_new_tokens else "length"
            toks = toks[: r.max_new_tokens]
            out.append(GenerateResult(toks, [-0.1] * len(toks), finish, 0, 1))
        return out

    def score(self, requests, sampling, weight_version):
        raise AssertionError("verify=decode verifies in the decode loop, not in a prefill")


def _decode_rollout(store, L=8):
    return SpeculativeRollout(OwnDraftEngine(), store, mode="exact", lenience=1.0, sampling=SamplingSettings(),
                              max_new_tokens=L, seed=0, verify="decode")


def test_decode_verification_counts_a_response_that_is_its_whole_draft_as_full_reuse():
    """verify=decode (the default for exact with tree drafting): a sample whose response is exactly its
    finished draft is full reuse, as it is with verify=prefill; every request goes through the engine's
    decode loop there, so `not needs_generation` alone counted none and spec/full_reuse_ratio was always 0."""
    store = TrajectoryStore()
    store.put("p", 0, Trajectory([9, 10, EOS], [-0.1] * 3, "stop", 0))       # finished by EOS: whole draft
    store.put("p", 1, Trajectory([9, 10, 11], [-0.1] * 3, "length", 0))      # L grew: the response goes on
    store.put("p", 2, Trajectory([9] * 8, [-0.1] * 8, "length", 0))          # L tokens: whole draft
    samples, m = _decode_rollout(store).run([("p", [5])], 4, 1, step=0)      # sample 3: no draft
    assert [s.response_ids for s in samples[:3]] == [[9, 10, EOS], [9, 10, 11, 50, 51, EOS], [9] * 8]
    assert [s.num_reused for s in samples] == [3, 3, 8, 0]
    assert m["spec/full_reuses"] == 2.0 and m["spec/full_reuse_ratio"] == 0.5
