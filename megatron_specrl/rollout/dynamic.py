"""DAPO's dynamic sampling over rollout rounds: the training step's DAPO filter.

Further prompt batches are rolled out until `target_groups` groups whose filter values are not all
equal are collected (by default 0 < correct < G: groups that all pass or all fail carry no GRPO
signal), failing clearly after `max_tries` rounds instead of hanging. A round is a function the step
hands in, so this module needs neither the engine nor the run: round(i) -> (samples, shaped rewards,
filter values, metrics), the filter values algorithm.filter_metric's (score_samples: by default
accuracies, 1.0 where a sample's task score counts correct, verl's `acc`).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch

from megatron_specrl.algorithms.dapo import dapo_keep_mask, dynamic_sample
from megatron_specrl.rollout.speculative import RolloutSample

RolloutRound = Callable[[int], tuple[list[RolloutSample], torch.Tensor, torch.Tensor, dict[str, float]]]


ADDITIVE_SUFFIXES = ("_tokens", "_s", "spec/drafts", "spec/nonfinite_logprobs", "spec/coupled_refreshed",
                     "spec/samples", "spec/full_reuses", "spec/lenient_excess", "spec/redraws",
                     "runahead/requests", "spec/decode_steps", "tree/engine_steps", "tree/engine_steps_longest",
                     "tree/request_steps", "tree/requests", "draft_model/drafts", "draft_model/engine_steps",
                     "draft_model/engine_steps_longest", "tree/undrafted_request_steps", "tree/threshold_sum",
                     "tree/threshold_steps", "tree/last_request_steps")
ADDITIVE_PREFIXES = ("tree_cost/", "tree_calib/")     # the step-cost fit's and the calibration's sums
# ratios of counters: recomputed from the step's sums (an average over rounds would weigh a small
# round like a full one); numerator and denominator as rollout/speculative.py and tree_metrics define them
RATIOS = {"tree/accept_rate": ("tree/accepted_tokens", "tree/draft_tokens"),
          "draft_model/accept_rate": ("draft_model/accepted_tokens", "draft_model/draft_tokens"),
          "draft_model/mean_accept_len": ("draft_model/accepted_tokens", "draft_model/drafts"),
          "tree/tokens_per_step": ("tree/generated_tokens", "tree/request_steps"),
          "tree/steps_per_request": ("tree/request_steps", "tree/requests"),
          "tree/cost_threshold": ("tree/threshold_sum", "tree/threshold_steps"),
          "spec/draft_tokens_per_step": ("tree/draft_tokens", "tree/engine_steps"),
          "tree/calibration_prompt": ("tree_calib/prompt_hits", "tree_calib/prompt_expected"),
          "tree/calibration_shared": ("tree_calib/shared_hits", "tree_calib/shared_expected"),
          "spec/mean_accept_len": ("spec/accepted_tokens", "spec/drafts"),
          "spec/reuse_ratio": ("spec/accepted_tokens", "spec/response_tokens"),
          "spec/full_reuse_ratio": ("spec/full_reuses", "spec/samples"),
          "spec/lenient_bias": ("spec/lenient_excess", "spec/lenient_accepted_tokens")}


MAXIMA = ("response/max_len",)
# the trees' size after the step's last round, and the cost fit in effect in it
GAUGES = ("tree/nodes", "tree/memory_mb", "tree/shared_nodes",
          "tree/fit_ms", "tree/fit_ms_per_request", "tree/fit_ms_per_draft_token", "tree/fit_ms_per_draft_token_error")


def _merge(rounds: list[dict]) -> dict[str, float]:
    """Sum counters and seconds over rounds, recompute RATIOS from the sums, take the largest of MAXIMA
    and the last round's GAUGES, average other means."""
    merged: dict[str, list[float]] = defaultdict(list)
    for m in rounds:
        for k, v in m.items():
            merged[k].append(v)

    def combine(k: str, v: list[float]) -> float:
        if k.endswith(ADDITIVE_SUFFIXES) or k.startswith(ADDITIVE_PREFIXES):
            return sum(v)
        if k in MAXIMA:
            return max(v)
        if k in GAUGES:
            return v[-1]
        return sum(v) / len(v)

    out = {k: combine(k, v) for k, v in merged.items()}
    for ratio, (num, den) in RATIOS.items():
        if ratio in out and num in out and den in out:
            out[ratio] = out[num] / max(out[den], 1.0)
    return out


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
    The filter decides on the round's filter values (by default the accuracies, so neither DAPO's
    length shaping nor its -1 / 1 scale, algorithm.incorrect_score, can flip it).

    A prompt kept in an earlier round is not kept again (a round past the loader's epoch end can
    draw it anew): GRPO groups by prompt id, so two kept groups of one prompt would merge into one
    group of 2G with another baseline, and a step would hold a prompt twice."""
    round_metrics = []
    kept_ids: set[str] = set()

    def generate(round_idx: int):
        samples, rewards, filter_values, metrics = rollout_round(round_idx)
        round_metrics.append(metrics)
        groups, keep = _groups(samples, rewards, dapo_keep_mask(filter_values, [s.prompt_id for s in samples]))
        keep = [k and group[0].prompt_id not in kept_ids for (group, _), k in zip(groups, keep)]
        kept_ids.update(group[0].prompt_id for (group, _), k in zip(groups, keep) if k)
        return groups, keep

    groups, stats = dynamic_sample(generate, target_groups, max_tries)
    metrics = {**_merge(round_metrics), **stats}
    return [s for group, _ in groups for s in group], torch.cat([r for _, r in groups]), metrics
