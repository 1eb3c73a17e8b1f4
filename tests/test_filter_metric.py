"""DAPO's group filter by verl's `filter_groups.metric` (algorithm.filter_metric): acc keeps groups
with 0 < correct < G; score keeps groups whose task rewards differ (graded rewards whose samples all
count correct); seq_reward keeps groups whose shaped rewards differ (equal answers, different length
penalties). The filter values come out of score_samples; filter_rounds keeps by them."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from megatron_specrl.algorithms.rewards_step import score_samples
from megatron_specrl.config import AlgorithmConfig
from megatron_specrl.rollout.dynamic import filter_rounds
from test_review_algorithms_s20 import _batch

L, BUF = 8, 4
SPEC = [("graded", 0.3, 3), ("graded", 0.7, 3),       # both correct (> 0), different scores
        ("long", 1.0, 3), ("long", 1.0, 8),           # both correct, one inside the overlong buffer
        ("same", 1.0, 3), ("same", 1.0, 3),           # nothing differs
        ("mixed", 1.0, 3), ("mixed", 0.0, 3)]         # right and wrong


def _kept(metric: str, n: int) -> list[str]:
    """The first n groups the filter keeps from one round (in arrival order, so a group kept that
    should not be shows up in place of a later one)."""
    alg = AlgorithmConfig(filter_metric=metric, overlong_buffer=BUF, overlong_penalty=1.0, dynamic_sampling=True)

    def round_(idx):
        samples, records, fn, tok = _batch(SPEC)
        rewards, values, metrics = score_samples(samples, records, fn, tok, alg, L)
        return samples, rewards, values, metrics

    samples, _, _ = filter_rounds(round_, target_groups=n, max_tries=1)
    return list(dict.fromkeys(s.prompt_id for s in samples))


@pytest.mark.parametrize("metric, kept", [("acc", ["mixed"]), ("score", ["graded", "mixed"]),
                                          ("seq_reward", ["graded", "long", "mixed"]),
                                          ("seq_final_reward", ["graded", "long", "mixed"])])
def test_groups_are_kept_by_the_chosen_metric(metric, kept):
    assert _kept(metric, len(kept)) == kept


def test_filter_values_are_the_metrics_own():
    samples, records, fn, tok = _batch(SPEC)
    for metric, want in [("acc", [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]),
                         ("score", [0.3, 0.7, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0])]:
        samples, records, fn, tok = _batch(SPEC)
        _, values, _ = score_samples(samples, records, fn, tok, AlgorithmConfig(filter_metric=metric), L)
        assert values.tolist() == pytest.approx(want)
    samples, records, fn, tok = _batch(SPEC)
    rewards, values, _ = score_samples(samples, records, fn, tok,
                                       AlgorithmConfig(filter_metric="seq_reward", overlong_buffer=BUF), L)
    assert values is rewards and rewards[3] == pytest.approx(0.0)     # 1 - 1 at max_new_tokens


def test_seq_final_reward_with_kl_in_reward_is_refused_and_unknown_metrics_too():
    with pytest.raises(ValidationError, match="seq_final_reward with use_kl_in_reward"):
        AlgorithmConfig(filter_metric="seq_final_reward", use_kl_in_reward=True)
    with pytest.raises(ValidationError, match="filter_metric"):
        AlgorithmConfig(filter_metric="std")
    AlgorithmConfig(filter_metric="seq_reward", use_kl_in_reward=True)     # before the KL: fine
