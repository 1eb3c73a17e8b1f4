"""Review of the speculative rollout core (rollout/speculative.py and the step around it)."""

from megatron_specrl.engines.protocol import GenerateResult, SamplingSettings
from megatron_specrl.rollout.speculative import SpeculativeRollout
from megatron_specrl.rollout.store import Trajectory, TrajectoryStore

EOS = 1


class OwnDraftEngine:
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
