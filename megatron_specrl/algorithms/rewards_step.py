"""Rewards for one rollout batch: the task reward per sample (on alg.incorrect_score's scale), its
accuracy, and DAPO's length shaping.

The training step calls `score_samples`, then grpo_advantages (GRPO, DAPO) or
algorithms.ppo.ppo_advantages (PPO); the recipe picks, the loop is the same for all three.
"""

from __future__ import annotations

import math

import torch

from megatron_specrl.algorithms.dapo import overlong_penalty
from megatron_specrl.config import AlgorithmConfig
from megatron_specrl.rewards import RewardError
from megatron_specrl.rollout.speculative import RolloutSample


def score_samples(samples: list[RolloutSample], records_by_id: dict, reward_fn, tokenizer,
                  alg: AlgorithmConfig, max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(shaped rewards, filter values, metrics).

    A sample's score s is reward_fn's value; its task reward is alg.incorrect_score + (1 -
    alg.incorrect_score) * s (0 / 1 -> incorrect_score / 1: DAPO's -1 / 1 with incorrect_score=-1), and
    the shaped reward adds DAPO's soft overlong punishment to it. Accuracy is 1.0 where s > 0 (verl's
    `acc`, as eval/accuracy counts it, so reward/accuracy stays in [0, 1]). The filter values are what
    DAPO's dynamic sampling keeps groups by (alg.filter_metric, verl's filter_groups.metric): the
    accuracies (acc, the default: neither the incorrect score nor the length shaping can flip the
    filter's decision), the task rewards (score) or the shaped rewards (seq_reward, seq_final_reward)."""
    texts = tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
    scores = torch.tensor([_finite_reward(reward_fn, t, records_by_id[s.prompt_id]) for t, s in zip(texts, samples)])
    correct = (scores > 0).float()
    task = alg.incorrect_score + (1.0 - alg.incorrect_score) * scores   # exactly the score at incorrect_score 0
    rewards = task.clone()
    lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float32)
    if alg.overlong_buffer > 0:
        rewards = rewards + overlong_penalty(lengths, max_new_tokens, alg.overlong_buffer,
                                             alg.overlong_penalty)
    metrics = {
        "reward/mean": float(rewards.mean()),
        "reward/task_mean": float(task.mean()),
        "reward/accuracy": float(correct.mean()),
        "response/mean_len": float(lengths.mean()),
        "response/max_len": float(lengths.max()),
        "response/clip_ratio": sum(s.finish_reason == "length" for s in samples) / len(samples),
    }
    filter_values = {"acc": correct, "score": task}.get(alg.filter_metric, rewards)
    return rewards, filter_values, metrics


def _finite_reward(reward_fn, text: str, record) -> float:
    """A NaN or inf reward would make its group's advantages, the loss and every gradient NaN: named
    here, before anything trains on it."""
    value = reward_fn(text, record)
    try:
        reward = float(value)
    except (TypeError, ValueError):
        reward = math.nan
    if not math.isfinite(reward):
        name = getattr(reward_fn, "__qualname__", repr(reward_fn))
        raise RewardError(f"reward {name} returned {value!r} for record {record.id!r} (response {text[:60]!r}); "
                          "rewards must be finite numbers")
    return reward


def group_ids_of(samples: list[RolloutSample]) -> list[str]:
    return [s.prompt_id for s in samples]

