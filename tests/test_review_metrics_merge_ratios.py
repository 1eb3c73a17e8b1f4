"""DAPO's rounds merged into one step: the speculative ratios (mean accept length, reuse, full reuse)
are those of the step's summed counts, as if its rounds had been one rollout (an average over rounds
would weigh a round of two samples like one of eight)."""

import math

import pytest
import torch

from megatron_specrl.engines.protocol import GenerateResult, SamplingSettings, ScoreResult
from megatron_specrl.rollout.dynamic import filter_rounds
from megatron_specrl.rollout.speculative import SpeculativeRollout
from megatron_specrl.rollout.store import Trajectory, TrajectoryStore

EOS = 1
REJECTED = 12   # the engine's log-prob of this draft token makes acceptance impossible


class Engine:
    name = "scripted"
    weight_version = 1

    def score(self, requests, sampling, weight_version):
        return [ScoreResult([math.log(1e-12) if t == REJECTED else 0.0 for t in r.continuation_ids], 1)
                for r in requests]

    def generate(self, requests, sampling, weight_version):
        return [GenerateResult([50, 51, 52, EOS][: r.max_new_tokens], [-0.5] * min(4, r.max_new_tokens), "stop", 0, 1)
                for r in requests]


DRAFTS = {("p0", 0): [9, 10, 11, 13, 14, EOS],    # fully accepted (ends at EOS): the whole sample reused
          ("p0", 1): [9, 10, 11, 13, 14, EOS],
          ("p1", 0): [9, 10, REJECTED, 13, EOS]}  # two tokens accepted, then extended
ROUNDS = [["p0"], ["p1", "p2", "p3", "p4"]]       # 2 samples, then 8 (one of them drafted)


def _rollout():
    store = TrajectoryStore()
    for (pid, k), draft in DRAFTS.items():
        store.put(pid, k, Trajectory(draft, [-0.1] * len(draft), "stop", 0))
    return SpeculativeRollout(Engine(), store, mode="exact", lenience=1.0, sampling=SamplingSettings(),
                              max_new_tokens=8, seed=0)


def test_merged_spec_ratios_are_those_of_the_union_of_the_rounds():
    rollout = _rollout()

    def round_(i):
        samples, metrics = rollout.run([(pid, [5]) for pid in ROUNDS[i]], 2, 1, step=f"1.{i}")
        # round 0's only group is uninformative (all correct), round 1's groups are mixed
        rewards = torch.tensor([1.0] * len(samples) if i == 0 else [1.0, 0.0] * (len(samples) // 2))
        return samples, rewards, rewards.clone(), metrics

    _, _, merged = filter_rounds(round_, target_groups=1, max_tries=2)
    assert merged["dapo/rounds"] == 2
    _, union = _rollout().run([(pid, [5]) for r in ROUNDS for pid in r], 2, 1, step="1.0")

    assert union["spec/mean_accept_len"] == pytest.approx((6 + 6 + 2) / 3)
    assert union["spec/reuse_ratio"] == pytest.approx(14 / (6 + 6 + 6 + 4 * 7))
    assert union["spec/full_reuse_ratio"] == pytest.approx(2 / 10)
    for key in ("spec/mean_accept_len", "spec/reuse_ratio", "spec/full_reuse_ratio",
                "spec/accepted_tokens", "spec/drafts"):
        assert merged[key] == pytest.approx(union[key]), key


def test_lenient_bias_is_the_summed_excess_over_the_summed_accepted_tokens():
    from megatron_specrl.rollout.dynamic import _merge
    rounds = [{"spec/lenient_bias": 0.5, "spec/lenient_excess": 1.0, "spec/lenient_accepted_tokens": 2.0},
              {"spec/lenient_bias": 0.0, "spec/lenient_excess": 0.0, "spec/lenient_accepted_tokens": 98.0}]
    assert _merge(rounds)["spec/lenient_bias"] == pytest.approx(1.0 / 100.0)


def test_longest_response_is_the_longest_of_any_round_and_tree_sizes_are_the_last_rounds():
    from megatron_specrl.rollout.dynamic import _merge
    rounds = [{"response/max_len": 40.0, "tree/nodes": 100.0, "tree/memory_mb": 1.0, "reward/mean": 0.2},
              {"response/max_len": 10.0, "tree/nodes": 180.0, "tree/memory_mb": 1.5, "reward/mean": 0.4}]
    out = _merge(rounds)
    assert out["response/max_len"] == 40.0 and out["tree/nodes"] == 180.0 and out["tree/memory_mb"] == 1.5
    assert out["reward/mean"] == pytest.approx(0.3)
