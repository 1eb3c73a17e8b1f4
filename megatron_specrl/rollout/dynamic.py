"""One step's rollouts with rewards, including DAPO's dynamic sampling.

Without dynamic sampling this is one speculative rollout of one prompt batch.
With it, further prompt batches are rolled out until `prompts_per_step` groups
with 0 < correct < G are collected (groups that all pass or all fail carry no
GRPO signal), failing clearly after `max_sampling_tries` rounds instead of hanging.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from megatron_specrl.algorithms.advantages import DynamicSamplingError, dapo_keep_mask
from megatron_specrl.algorithms.rewards_step import score_samples


def _rollout_round(run, step: int, round_idx: int):
    records = run.loader.next_batch()
    prompts = [(r.id, run.prompt_ids(r)) for r in records]
    samples, metrics = run.rollout.run(prompts, run.cfg.rollout.n_samples, run.version, step=f"{step}.{round_idx}")
    rewards, reward_metrics = score_samples(samples, run.train_records, run.reward_fn, run.tokenizer, run.cfg)
    return samples, rewards, {**metrics, **reward_metrics}


def _merge(rounds: list[dict]) -> dict[str, float]:
    """Sum counters and seconds over rounds, average ratios and means."""
    merged: dict[str, list[float]] = defaultdict(list)
    for m in rounds:
        for k, v in m.items():
            merged[k].append(v)
    additive = ("_tokens", "_s", "spec/drafts")
    return {k: (sum(v) if k.endswith(additive) else sum(v) / len(v)) for k, v in merged.items()}


def collect_rollouts(run, step: int):
    alg = run.cfg.algorithm
    if not alg.dynamic_sampling:
        return _rollout_round(run, step, 0)
    target = run.cfg.trainer.prompts_per_step
    kept_samples, kept_rewards, round_metrics = [], [], []
    for round_idx in range(alg.max_sampling_tries):
        samples, rewards, metrics = _rollout_round(run, step, round_idx)
        round_metrics.append(metrics)
        keep = dapo_keep_mask(rewards, [s.prompt_id for s in samples])
        kept_samples += [s for s, k in zip(samples, keep.tolist()) if k]
        kept_rewards.append(rewards[keep])
        if len({s.prompt_id for s in kept_samples}) >= target:
            break
    groups = list(dict.fromkeys(s.prompt_id for s in kept_samples))
    if len(groups) < target:
        raise DynamicSamplingError(
            f"dynamic sampling kept {len(groups)} of {target} prompt groups after "
            f"algorithm.max_sampling_tries={alg.max_sampling_tries} rounds: every other group was all-correct "
            f"or all-wrong. Raise max_sampling_tries, or use a harder/easier dataset.")
    chosen = set(groups[:target])
    rewards = torch.cat(kept_rewards)
    idx = [i for i, s in enumerate(kept_samples) if s.prompt_id in chosen]
    metrics = _merge(round_metrics)
    metrics["dapo/sampling_rounds"] = len(round_metrics)
    metrics["dapo/kept_group_ratio"] = len(groups) / (len(round_metrics) * target)
    return [kept_samples[i] for i in idx], rewards[idx], metrics
