"""Statistical check: `exact` speculative rollouts are samples of the new policy; `lenient` is not.

Tiny enumerable case (vocab 3 with EOS, responses of at most 3 tokens, a fixed
pair of old and new tabular policies) so the exact response distribution is known.
The same check through the real vLLM engine at temperature 0.7 / top-p 0.9 is in
tests/test_processed_verification.py.
"""

import dataclasses

import numpy as np
import pytest
from scipy.stats import chisquare

import megatron_specrl.rollout.speculative as speculative
from megatron_specrl.engines.protocol import SamplingSettings
from megatron_specrl.rollout.acceptance import Acceptance
from megatron_specrl.rollout.store import TrajectoryStore
from tabular_engine import TabularEngine, TabularPolicy

PROMPT = [7]
L = 3
OLD = TabularPolicy(3)
NEW = TabularPolicy(3, update_seed=1, drift=1.0)
N = 6000
T1 = SamplingSettings()


def _old_store(policy=OLD, sampling=T1) -> TrajectoryStore:
    store = TrajectoryStore()
    engine = TabularEngine(policy)
    speculative.SpeculativeRollout(engine, store, mode="off", lenience=1.0, sampling=sampling,
                                   max_new_tokens=L, seed=0).run([("p", PROMPT)], N, 0, step=0)
    return store


def _spec_samples(mode: str, lenience: float = 1.0, sampling=T1, engine=None, policy=NEW, old=OLD):
    store = _old_store(old)
    engine = engine or TabularEngine(policy, version=1)
    roll = speculative.SpeculativeRollout(engine, store, mode=mode, lenience=lenience, sampling=sampling,
                                          max_new_tokens=L, seed=123)
    samples, metrics = roll.run([("p", PROMPT)], N, 1, step=1)
    return [tuple(s.response_ids) for s in samples], metrics


def _compare(responses, policy=NEW, sampling=T1):
    target = policy.sequence_distribution(tuple(PROMPT), L, sampling)
    keys = sorted(target)
    counts = np.array([sum(r == k for r in responses) for k in keys], dtype=float)
    expected = np.array([target[k] for k in keys]) * len(responses)
    assert counts.sum() == len(responses), "a response fell outside the enumerated support"
    tv = 0.5 * np.abs(counts / counts.sum() - expected / expected.sum()).sum()
    big = expected >= 5   # pool rare outcomes into one bin for the chi-square approximation
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp).pvalue, tv


def test_exact_mode_samples_the_new_policy():
    responses, metrics = _spec_samples("exact")
    pvalue, tv = _compare(responses)
    assert metrics["spec/accepted_tokens"] > 0.2 * metrics["spec/verified_tokens"], "test has no reuse to check"
    assert metrics["spec/replaced_tokens"] > 0.1 * N, "test has no replacement to check"
    assert pvalue > 1e-3, f"exact speculative rollouts differ from the new policy (p={pvalue:.2e}, tv={tv:.3f})"


def test_exact_mode_with_the_ban_fallback_samples_the_new_policy():
    """An engine without replacements (SGLang at temperature 1): the extension bans y_n instead."""
    responses, metrics = _spec_samples("exact", engine=TabularEngine(NEW, version=1, replacements=False))
    assert metrics["spec/replaced_tokens"] == 0
    pvalue, tv = _compare(responses)
    assert pvalue > 1e-3, f"exact rollouts with the ban fallback differ from the new policy (p={pvalue:.2e})"


def test_exact_mode_samples_the_processed_policy_at_temperature_and_top_p():
    """Temperature 0.7 / top-p 0.8 (vocab 5, so the nucleus really truncates); drafts from another
    policy at temperature 1, so many lie outside the new nucleus and are rejected."""
    new, old = TabularPolicy(5, update_seed=1, drift=1.0, scale=1.5), TabularPolicy(5, scale=1.5)
    sampling = SamplingSettings(temperature=0.7, top_p=0.8)
    assert min(np.count_nonzero(new.probs((7, *c), sampling)) for c in [(), (1,), (2,)]) < 5
    responses, metrics = _spec_samples("exact", sampling=sampling, policy=new, old=old)
    pvalue, tv = _compare(responses, new, sampling)   # also: no response outside the nucleus
    assert metrics["spec/replaced_tokens"] > 0.1 * N
    assert pvalue > 1e-3, f"exact rollouts differ from the processed new policy (p={pvalue:.2e}, tv={tv:.3f})"


def test_plain_generation_matches_too():
    """Sanity check of the harness itself: mode=off is plain sampling from the new policy."""
    responses, _ = _spec_samples("off")
    pvalue, _ = _compare(responses)
    assert pvalue > 1e-3


class _LastPositionUnverified(TabularEngine):
    """An engine at the model's max_position_embeddings (protocol.score): a continuation reaching the
    last position is verified without its last token."""

    def score(self, requests, sampling, weight_version):
        room = len(PROMPT) + L - 1
        requests = [dataclasses.replace(r, continuation_ids=r.continuation_ids[:room - len(r.prompt_ids)])
                    for r in requests]
        return super().score(requests, sampling, weight_version)


@pytest.mark.parametrize("sampling", [T1, SamplingSettings(temperature=0.7, top_p=0.8)])
def test_exact_mode_is_exact_when_the_engine_verifies_a_full_length_draft_in_part(sampling):
    """The rollout takes the verified prefix as the draft; its last token is sampled by the extension
    (it failed with mismatched lengths when a verification came back shorter than its draft)."""
    responses, metrics = _spec_samples("exact", sampling=sampling, engine=_LastPositionUnverified(NEW, version=1))
    assert sum(len(r) == L for r in responses) > 0.2 * N, "test has no full-length draft to check"
    pvalue, tv = _compare(responses, NEW, sampling)
    assert metrics["spec/accepted_tokens"] > 0.2 * metrics["spec/verified_tokens"]
    assert pvalue > 1e-3, f"exact rollouts differ from the new policy (p={pvalue:.2e}, tv={tv:.3f})"


class _UnexcludedReplacements(TabularEngine):
    """A buggy engine: the replacement is drawn from the full distribution (y_n not excluded)."""

    def score(self, requests, sampling, weight_version):
        out = super().score(requests, sampling, weight_version)
        for r, res in zip(requests, out):
            rng = np.random.default_rng([r.seed, 99])
            ctx = tuple(r.prompt_ids)
            for pos, tok in enumerate(r.continuation_ids):
                p = self.policy.probs(ctx, sampling)
                res.replacements[pos] = int(rng.choice(len(p), p=p))
                res.replacement_sample_logprobs[pos] = float(np.log(p[res.replacements[pos]]))
                res.replacement_stops[pos] = res.replacements[pos] == 0
                ctx = ctx + (tok,)
        return out


def test_exact_without_excluding_the_rejected_token_is_detected(monkeypatch):
    responses, _ = _spec_samples("exact", engine=_UnexcludedReplacements(NEW, version=1))
    pvalue, tv = _compare(responses)
    assert pvalue < 1e-6, f"the chi-square test cannot see a biased replacement (p={pvalue:.2e})"

    real_decide = speculative.decide

    def no_ban(*args, **kwargs):
        acc = real_decide(*args, **kwargs)
        return Acceptance(acc.num_accepted, None, acc.lenient_excess)

    monkeypatch.setattr(speculative, "decide", no_ban)   # the ban fallback without its ban
    responses, _ = _spec_samples("exact", engine=TabularEngine(NEW, version=1, replacements=False))
    pvalue, tv = _compare(responses)
    assert pvalue < 1e-6, f"the chi-square test cannot see a biased resample (p={pvalue:.2e})"


@pytest.mark.parametrize("lenience", [1.0, float(np.exp(0.5))])
def test_lenient_is_measurably_biased(lenience):
    exact_tv = _compare(_spec_samples("exact")[0])[1]
    responses, metrics = _spec_samples("lenient", lenience)
    pvalue, tv = _compare(responses)
    print(f"lenient l={lenience:.3f}: TV to the new policy {tv:.4f} (exact {exact_tv:.4f}), "
          f"reuse {metrics['spec/reuse_ratio']:.2f}, bias metric {metrics['spec/lenient_bias']:.3f}")
    assert pvalue < 1e-3 and tv > exact_tv
    assert metrics["spec/lenient_bias"] > 0


def test_rollout_refuses_settings_the_engine_cannot_verify():
    """SpeculativeRollout asks the engine (verifies_processed_distribution) before any request."""
    sglang_like = TabularEngine(NEW, version=1, replacements=False)
    for mode in ("exact", "lenient"):
        for s in (SamplingSettings(temperature=0.7), SamplingSettings(top_p=0.9), SamplingSettings(top_k=20)):
            with pytest.raises(NotImplementedError, match="cannot verify"):
                speculative.SpeculativeRollout(sglang_like, TrajectoryStore(), mode=mode, lenience=1.0, sampling=s,
                                               max_new_tokens=L, seed=0)
    speculative.SpeculativeRollout(sglang_like, TrajectoryStore(), mode="off", lenience=1.0,
                                   sampling=SamplingSettings(temperature=0.7, top_p=0.9), max_new_tokens=L, seed=0)
    speculative.SpeculativeRollout(TabularEngine(NEW), TrajectoryStore(), mode="exact", lenience=1.0,
                                   sampling=SamplingSettings(temperature=0.7, top_p=0.9), max_new_tokens=L, seed=0)
    assert sglang_like.calls == []
