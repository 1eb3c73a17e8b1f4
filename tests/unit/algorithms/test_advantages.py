"""Advantage estimators against hand-computed values.
"""

import pytest
import torch
from megatron_specrl.algorithms.advantages import gae, grpo_advantages, terminal_rewards, whiten
from megatron_specrl.algorithms.dapo import (
    DynamicSampler, DynamicSamplingError, dapo_keep_mask, dynamic_sample, overlong_penalty,
)

def close(a, b):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=1e-5)


def test_grpo_with_and_without_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.5])
    groups = ["a", "a", "a", "a", "b", "b", "c"]
    # group a: mean 0.25, unbiased std sqrt((0.5625 + 3 * 0.0625) / 3) = 0.5
    assert close(grpo_advantages(rewards, groups, normalize_std=False), [0.75, -0.25, -0.25, -0.25, 0, 0, 0])
    assert close(grpo_advantages(rewards, groups, normalize_std=True, eps=0.0), [1.5, -0.5, -0.5, -0.5, 0, 0, 0])
    # group b has zero std and c is a group of one: both 0, never NaN
    adv = grpo_advantages(rewards, groups, normalize_std=True)
    assert torch.isfinite(adv).all() and (adv[4:] == 0).all()


def test_grpo_equal_reward_groups_get_exactly_zero():
    """max == min is checked exactly: float32 std of 6 x 0.3 is 3e-8, not 0, and (r - mean) / (std + eps)
    gave every sample +0.029 (12 x 1.1: -0.106). Shaped rewards hit this; 0/1 rewards do not."""
    rewards = torch.tensor([0.3] * 6 + [1.1] * 12 + [0.0, 1.0])
    groups = [0] * 6 + [1] * 12 + [2, 2]
    for normalize_std in (True, False):
        adv = grpo_advantages(rewards, groups, normalize_std=normalize_std)
        assert adv[:18].tolist() == [0.0] * 18, normalize_std
    # the mixed group is untouched: mean 0.5, unbiased std sqrt(0.5)
    adv = grpo_advantages(rewards, groups, normalize_std=True, eps=0.0)
    assert close(adv[18:], [-0.5 / 0.5 ** 0.5, 0.5 / 0.5 ** 0.5])


def test_grpo_interleaved_tensor_group_ids():
    rewards = torch.tensor([2.0, 1.0, 0.0, 3.0])
    adv = grpo_advantages(rewards, torch.tensor([7, 9, 7, 9]), normalize_std=False)
    assert close(adv, [1.0, -1.0, -1.0, 1.0])
    with pytest.raises(ValueError, match="group ids"):
        grpo_advantages(rewards, [0, 1], normalize_std=False)


def test_dapo_keep_mask():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, -0.3, 0.7])
    groups = [0, 0, 1, 1, 2, 2, 3, 3]
    # group 0 mixed: keep; 1 all correct, 2 all wrong: drop; 3: reward > 0 counts as correct -> mixed
    assert dapo_keep_mask(rewards, groups).tolist() == [True, True, False, False, False, False, True, True]


def test_dynamic_sampler_collects_and_trims():
    rounds = iter([(["g0", "g1", "g2"], [True, False, True]),
                   (["g3", "g4", "g5"], [False, False, False]),
                   (["g6", "g7", "g8"], [True, True, True])])
    groups, stats = dynamic_sample(lambda i: next(rounds), target_groups=4, max_tries=4)
    assert groups == ["g0", "g2", "g6", "g7"]                      # exactly target, in arrival order
    assert stats["dapo/rounds"] == 3 and stats["dapo/groups_seen"] == 9


def test_dynamic_sampler_gives_up_after_max_tries():
    calls = []

    def all_solved(i):
        calls.append(i)
        return ["g"] * 4, torch.zeros(4, dtype=torch.bool)

    with pytest.raises(DynamicSamplingError, match="0/2 groups after 3 rounds"):
        dynamic_sample(all_solved, target_groups=2, max_tries=3)
    assert calls == [0, 1, 2]                                      # bounded, no hang

    s = DynamicSampler(target_groups=2, max_tries=2)
    s.add(["a"], [True])
    with pytest.raises(DynamicSamplingError, match="1/2"):
        s.result()


def test_overlong_penalty():
    # max_len 16, buffer 4: free up to 12, then -0.25 per token down to -1 at 16
    assert close(overlong_penalty([5, 12, 13, 14, 16, 20], max_len=16, buffer=4, penalty_factor=1.0),
                 [0, 0, -0.25, -0.5, -1.0, -1.0])
    assert close(overlong_penalty([14], max_len=16, buffer=4, penalty_factor=0.5), [-0.25])
    assert close(overlong_penalty([16], max_len=16, buffer=0, penalty_factor=1.0), [0])


def test_gae_hand_worked_three_tokens():
    mask = torch.tensor([[1, 1, 1, 0]])
    rewards = terminal_rewards(torch.tensor([1.0]), mask)
    assert rewards.tolist() == [[0, 0, 1, 0]]
    values = torch.tensor([[0.5, 0.2, 0.8, 9.0]])                  # the padded value must be ignored
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.5)
    # t2: delta = 1 - 0.8 = 0.2;             A2 = 0.2
    # t1: delta = 0 + 0.8 - 0.2 = 0.6;       A1 = 0.6 + 0.5 * 0.2 = 0.7
    # t0: delta = 0 + 0.2 - 0.5 = -0.3;      A0 = -0.3 + 0.5 * 0.7 = 0.05
    assert close(adv, [[0.05, 0.7, 0.2, 0.0]])
    assert close(ret, [[0.55, 0.9, 1.0, 0.0]])

    # gamma < 1 discounts the bootstrap: t1 delta = 0.9 * 0.8 - 0.2 = 0.52, A1 = 0.52 + 0.9 * 0.2 = 0.7
    adv, _ = gae(rewards, values, mask, gamma=0.9, lam=1.0)
    assert close(adv[0, 1], 0.7) and close(adv[0, 2], 0.2)


def test_gae_skips_masked_positions_inside_the_response():
    mask = torch.tensor([[1, 0, 1]])
    values = torch.tensor([[0.5, 100.0, 0.8]])
    adv, _ = gae(torch.tensor([[0.0, 5.0, 1.0]]), values, mask, gamma=1.0, lam=1.0)
    # the masked middle token contributes neither reward nor value: same as the 2-token sequence
    ref, _ = gae(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.8]]), torch.ones(1, 2), gamma=1.0, lam=1.0)
    assert close(adv[0, [0, 2]], ref[0]) and adv[0, 1] == 0


def test_whiten():
    x = torch.tensor([[1.0, 2.0, 3.0, 50.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    w = whiten(x, mask)
    assert close(w, [[-1.0, 0.0, 1.0, 0.0]])                       # unbiased std of 1,2,3 is 1
    assert close(whiten(x, mask, shift_mean=False), [[1.0, 2.0, 3.0, 0.0]])
