"""Rewards for one rollout batch: the task reward per sample, and DAPO's length shaping.

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
    """(shaped rewards, task rewards, metrics): task reward per sample, plus DAPO's soft overlong
    punishment in the shaped one. Filters decide on task rewards, so shaping cannot flip them."""
    texts = tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
    task = torch.tensor([_finite_reward(reward_fn, t, records_by_id[s.prompt_id]) for t, s in zip(texts, samples)])
    rewards = task.clone()
    lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float32)
    if alg.overlong_buffer > 0:
        rewards = rewards + overlong_penalty(lengths, max_new_tokens, alg.overlong_buffer,
                                             alg.overlong_penalty)
    metrics = {
        "reward/mean": float(rewards.mean()),
        "reward/task_mean": float(task.mean()),
        "reward/accuracy": float((task > 0).float().mean()),
        "response/mean_len": float(lengths.mean()),
        "response/max_len": float(lengths.max()),
        "response/clip_ratio": sum(s.finish_reason == "length" for s in samples) / len(samples),
    }
    return rewards, task, metrics


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

