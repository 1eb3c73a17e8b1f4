"""DAPO dynamic sampling over rollout rounds (the step's DAPO filter): fills the batch, or fails clearly
(no hang)."""

import pytest
import torch

from megatron_specrl.algorithms.dapo import DynamicSamplingError
from megatron_specrl.rollout.dynamic import filter_rounds
from megatron_specrl.rollout.speculative import RolloutSample


def _samples(group_rewards: dict[str, list[float]]):
    samples, rewards = [], []
    for pid, rs in group_rewards.items():
        for k, r in enumerate(rs):
            samples.append(RolloutSample(pid, k, [5], [9, 1], [-0.1, -0.1], "stop", 0, 0))
            rewards.append(r)
    t = torch.tensor(rewards)
    return samples, t, t.clone(), {"spec/rollout_s": 0.5, "reward/mean": float(t.mean()),
                                   "spec/nonfinite_logprobs": 1.0, "runahead/requests": 2.0}


def test_all_groups_filtered_raises_after_max_tries():
    calls = []

    def round_(idx):
        calls.append(idx)
        return _samples({f"a{idx}": [1.0, 1.0], f"b{idx}": [0.0, 0.0]})   # all-correct / all-wrong

    with pytest.raises(DynamicSamplingError, match="0/2 groups after 3 rounds"):
        filter_rounds(round_, target_groups=2, max_tries=3)
    assert calls == [0, 1, 2]


def test_rounds_accumulate_until_the_batch_is_full():
    rounds = [{"a": [1.0, 0.0], "b": [1.0, 1.0]}, {"c": [0.0, 0.0], "d": [0.0, 1.0], "e": [1.0, 0.0]}]
    samples, rewards, metrics = filter_rounds(lambda idx: _samples(rounds[idx]), target_groups=2, max_tries=4)
    assert [s.prompt_id for s in samples] == ["a", "a", "d", "d"]       # exactly 2 informative groups
    assert rewards.tolist() == [1.0, 0.0, 0.0, 1.0]
    assert metrics["dapo/rounds"] == 2 and metrics["spec/rollout_s"] == 1.0   # seconds add up over rounds
    assert metrics["spec/nonfinite_logprobs"] == 2.0 and metrics["runahead/requests"] == 4.0   # so do counts


def test_filter_decides_on_task_rewards_and_returns_shaped_ones():
    """DAPO's overlong shaping must not flip the filter: a group all correct by task reward is
    dropped even if shaping made one of its rewards negative, and kept groups carry shaped rewards."""
    def round_(idx):
        samples, task, _, metrics = _samples({"solved": [1.0, 1.0], "mixed": [1.0, 0.0]})
        shaped = task - torch.tensor([0.0, 1.5, 0.25, 0.0])
        return samples, shaped, task, metrics
    samples, rewards, _ = filter_rounds(round_, target_groups=1, max_tries=1)
    assert [s.prompt_id for s in samples] == ["mixed", "mixed"]
    assert rewards.tolist() == [0.75, 0.0]
