"""One step's rollouts with rewards, including DAPO's dynamic sampling.

Without dynamic sampling this is one speculative rollout of one prompt batch.
With it, further prompt batches are rolled out until `prompts_per_step` groups
with 0 < correct < G are collected (groups that all pass or all fail carry no
GRPO signal), failing clearly after `max_sampling_tries` rounds instead of hanging.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from megatron_specrl.algorithms.dapo import dapo_keep_mask, dynamic_sample
from megatron_specrl.algorithms.rewards_step import score_samples


def _rollout_round(run, step: int, round_idx: int):
    records = run.loader.next_batch()
    prompts = [(r.id, run.prompt_ids(r)) for r in records]
    samples, metrics = run.rollout.run(prompts, run.cfg.rollout.n_samples, run.version, step=f"{step}.{round_idx}")
    rewards, task, reward_metrics = score_samples(samples, run.train_records, run.reward_fn, run.tokenizer, run.cfg)
    return samples, rewards, task, {**metrics, **reward_metrics}


def _merge(rounds: list[dict]) -> dict[str, float]:
    """Sum counters and seconds over rounds, average ratios and means."""
    merged: dict[str, list[float]] = defaultdict(list)
    for m in rounds:
        for k, v in m.items():
            merged[k].append(v)
    additive = ("_tokens", "_s", "spec/drafts")
    return {k: (sum(v) if k.endswith(additive) else sum(v) / len(v)) for k, v in merged.items()}


def _groups(samples, rewards, keep):
    """Group samples by prompt (arrival order) -> ([(samples, rewards)], [keep flag per group])."""
    by_id: dict[str, list[int]] = defaultdict(list)
    for i, s in enumerate(samples):
        by_id[s.prompt_id].append(i)
    groups = [([samples[i] for i in idx], rewards[idx]) for idx in by_id.values()]
    return groups, [bool(keep[idx[0]]) for idx in by_id.values()]


def collect_rollouts(run, step: int):
    """-> (samples, shaped rewards, metrics) for the step's training batch."""
    alg = run.cfg.algorithm
    if not alg.dynamic_sampling:
        samples, rewards, _, metrics = _rollout_round(run, step, 0)
        return samples, rewards, metrics
    round_metrics = []

    def generate(round_idx: int):
        samples, rewards, task, metrics = _rollout_round(run, step, round_idx)
        round_metrics.append(metrics)
        return _groups(samples, rewards, dapo_keep_mask(task, [s.prompt_id for s in samples]))

    groups, stats = dynamic_sample(generate, run.cfg.trainer.prompts_per_step, alg.max_sampling_tries)
    metrics = {**_merge(round_metrics), **stats}
    return [s for group, _ in groups for s in group], torch.cat([r for _, r in groups]), metrics
