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


def test_step_counts_add_up_over_rounds_and_ratios_come_from_the_sums():
    """A step of two DAPO rounds decoded in both: its decode and engine steps, request steps and the
    step-cost sums are the rounds' sums; accept rate and tokens per step are those of the summed counts
    (bench-rollout divides summed tokens by request steps: averaged steps inflated it by the rounds)."""
    tree = [{"spec/decode_steps": 20.0, "tree/engine_steps": 20.0, "tree/request_steps": 100.0,
             "tree/generated_tokens": 500.0, "tree/draft_tokens": 800.0, "tree/accepted_tokens": 400.0,
             "tree/accept_rate": 0.5, "tree/tokens_per_step": 5.0, "tree_cost/n": 19.0},
            {"spec/decode_steps": 10.0, "tree/engine_steps": 10.0, "tree/request_steps": 20.0,
             "tree/generated_tokens": 40.0, "tree/draft_tokens": 200.0, "tree/accepted_tokens": 20.0,
             "tree/accept_rate": 0.1, "tree/tokens_per_step": 2.0, "tree_cost/n": 9.0}]
    rounds = [{"a": [1.0, 1.0]}, {"b": [1.0, 0.0]}]

    def round_(idx):
        samples, rewards, task, metrics = _samples(rounds[idx])
        return samples, rewards, task, {**metrics, **tree[idx]}

    _, _, m = filter_rounds(round_, target_groups=1, max_tries=2)
    assert m["spec/decode_steps"] == 30.0 and m["tree/engine_steps"] == 30.0 and m["tree/request_steps"] == 120.0
    assert m["tree_cost/n"] == 28.0
    assert m["tree/accept_rate"] == 420.0 / 1000.0 and m["tree/tokens_per_step"] == 540.0 / 120.0


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


def test_a_prompt_kept_in_an_earlier_round_is_not_kept_again():
    """A later round can draw a prompt again (the loader's epoch ended between rounds). Kept twice,
    its two groups would share the prompt id, which GRPO groups by: one merged group of 2G samples
    with another baseline (and a step holding a prompt twice). The repeat is dropped instead."""
    from megatron_specrl.algorithms.advantages import grpo_advantages
    from megatron_specrl.algorithms.rewards_step import group_ids_of

    rounds = [{"a": [1.0, 0.0, 0.0, 0.0], "x": [1.0, 1.0, 1.0, 1.0]},
              {"a": [1.0, 1.0, 1.0, 0.0], "b": [0.0, 1.0, 0.0, 0.0]}]
    samples, rewards, metrics = filter_rounds(lambda idx: _samples(rounds[idx]), target_groups=2, max_tries=4)
    assert [s.prompt_id for s in samples] == ["a"] * 4 + ["b"] * 4
    assert rewards.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    adv = grpo_advantages(rewards, group_ids_of(samples), normalize_std=False)
    assert adv[:4].tolist() == [0.75, -0.25, -0.25, -0.25]        # group a's own baseline (mean 0.25)
