"""DAPO's dynamic sampling over rollout rounds: the training step's DAPO filter.

Further prompt batches are rolled out until `target_groups` groups with 0 < correct < G are
collected (groups that all pass or all fail carry no GRPO signal), failing clearly after
`max_tries` rounds instead of hanging. A round is a function the step hands in, so this module
needs neither the engine nor the run: round(i) -> (samples, shaped rewards, task rewards, metrics).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch

from megatron_specrl.algorithms.dapo import dapo_keep_mask, dynamic_sample
from megatron_specrl.rollout.speculative import RolloutSample

RolloutRound = Callable[[int], tuple[list[RolloutSample], torch.Tensor, torch.Tensor, dict[str, float]]]


def _merge(rounds: list[dict]) -> dict[str, float]:
    """Sum counters and seconds over rounds, average ratios and means."""
    merged: dict[str, list[float]] = defaultdict(list)
    for m in rounds:
        for k, v in m.items():
            merged[k].append(v)
    additive = ("_tokens", "_s", "spec/drafts", "spec/nonfinite_logprobs", "spec/coupled_refreshed",
                "runahead/requests")
    return {k: (sum(v) if k.endswith(additive) else sum(v) / len(v)) for k, v in merged.items()}


def _groups(samples, rewards, keep):
    """Group samples by prompt (arrival order) -> ([(samples, rewards)], [keep flag per group])."""
    by_id: dict[str, list[int]] = defaultdict(list)
    for i, s in enumerate(samples):
        by_id[s.prompt_id].append(i)
    groups = [([samples[i] for i in idx], rewards[idx]) for idx in by_id.values()]
    return groups, [bool(keep[idx[0]]) for idx in by_id.values()]


def filter_rounds(rollout_round: RolloutRound, target_groups: int,
                  max_tries: int) -> tuple[list[RolloutSample], torch.Tensor, dict[str, float]]:
    """Rounds until `target_groups` informative groups -> (their samples, shaped rewards, metrics).
    The filter decides on task rewards, so DAPO's length shaping cannot flip it."""
    round_metrics = []

    def generate(round_idx: int):
        samples, rewards, task, metrics = rollout_round(round_idx)
        round_metrics.append(metrics)
        return _groups(samples, rewards, dapo_keep_mask(task, [s.prompt_id for s in samples]))

    groups, stats = dynamic_sample(generate, target_groups, max_tries)
    metrics = {**_merge(round_metrics), **stats}
    return [s for group, _ in groups for s in group], torch.cat([r for _, r in groups]), metrics
