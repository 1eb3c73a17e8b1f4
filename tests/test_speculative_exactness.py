"""Statistical check: `exact` speculative rollouts are samples of the new policy; `lenient` is not.

Tiny enumerable case (vocab 3 with EOS, responses of at most 3 tokens, a fixed
pair of old and new tabular policies) so the exact response distribution is known.
"""

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


def _old_store() -> TrajectoryStore:
    store = TrajectoryStore()
    engine = TabularEngine(OLD)
    speculative.SpeculativeRollout(engine, store, mode="off", lenience=1.0, sampling=SamplingSettings(),
                                   max_new_tokens=L, seed=0).run([("p", PROMPT)], N, 0, step=0)
    return store


def _spec_samples(mode: str, lenience: float = 1.0):
    store = _old_store()
    engine = TabularEngine(NEW, version=1)
    roll = speculative.SpeculativeRollout(engine, store, mode=mode, lenience=lenience, sampling=SamplingSettings(),
                                          max_new_tokens=L, seed=123)
    samples, metrics = roll.run([("p", PROMPT)], N, 1, step=1)
    return [tuple(s.response_ids) for s in samples], metrics


def _compare(responses):
    target = NEW.sequence_distribution(tuple(PROMPT), L)
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
    assert pvalue > 1e-3, f"exact speculative rollouts differ from the new policy (p={pvalue:.2e}, tv={tv:.3f})"


def test_plain_generation_matches_too():
    """Sanity check of the harness itself: mode=off is plain sampling from the new policy."""
    responses, _ = _spec_samples("off")
    pvalue, _ = _compare(responses)
    assert pvalue > 1e-3


def test_exact_without_excluding_the_rejected_token_is_detected(monkeypatch):
    real_decide = speculative.decide

    def no_ban(*args, **kwargs):
        acc = real_decide(*args, **kwargs)
        return Acceptance(acc.num_accepted, None, acc.lenient_excess)

    monkeypatch.setattr(speculative, "decide", no_ban)
    responses, _ = _spec_samples("exact")
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
