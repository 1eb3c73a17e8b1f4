"""DAPO's data-side pieces: dynamic sampling and the soft overlong penalty (Yu et al., 2025).

Dynamic sampling drops groups whose samples were all right or all wrong: their
group-relative advantages are all zero, so they only dilute the batch. It
regenerates until enough informative groups are collected, with a bound on
the number of rounds so an all-solved (or all-failed) task fails loudly
instead of looping forever.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Generic, Sequence, TypeVar

import torch

from megatron_specrl.algorithms.advantages import group_index

T = TypeVar("T")


class DynamicSamplingError(RuntimeError):
    """max_tries generation rounds did not yield target_groups informative groups."""


def dapo_keep_mask(values: torch.Tensor, group_ids) -> torch.Tensor:
    """Bool [N]: True for samples whose group's values are not all equal (verl's filter: `std > 0`,
    compared exactly, max != min), or whose group is a single sample (verl: `or len == 1`; only
    rollout.n_samples=1, i.e. PPO, has such groups, and dropping them all would only end the run after
    max_sampling_tries rounds).

    The values are algorithm.filter_metric's (score_samples): by default accuracies (verl's `acc`,
    1 / 0), for which this keeps 0 < correct < G, so neither the overlong penalty nor a -1 / 1 task
    scale (algorithm.incorrect_score) can flip the decision.
    """
    values = torch.as_tensor(values, dtype=torch.float32).flatten()
    idx, num_groups = group_index(group_ids, values.numel())
    hi = torch.full((num_groups,), -torch.inf).scatter_reduce_(0, idx, values, "amax")
    lo = torch.full((num_groups,), torch.inf).scatter_reduce_(0, idx, values, "amin")
    sizes = torch.zeros(num_groups).index_add_(0, idx, torch.ones_like(values))
    keep_group = (hi != lo) | (sizes == 1)
    return keep_group[idx]


@dataclass
class DynamicSampler(Generic[T]):
    """Accumulates kept groups over generation rounds until target_groups are collected.

        sampler = DynamicSampler(target_groups=16, max_tries=4)
        while not sampler.done:
            groups = generate()                          # raises DynamicSamplingError when out of tries
            sampler.add(groups, [informative(g) for g in groups])
        batch = sampler.result()                         # exactly 16 groups, in arrival order
    """

    target_groups: int
    max_tries: int
    kept: list = field(default_factory=list)
    tries: int = 0
    seen: int = 0

    def __post_init__(self):
        if self.target_groups < 1 or self.max_tries < 1:
            raise ValueError(f"target_groups={self.target_groups} and max_tries={self.max_tries} must be >= 1")

    @property
    def done(self) -> bool:
        return len(self.kept) >= self.target_groups

    def add(self, groups: Sequence[T], keep: Sequence[bool] | torch.Tensor) -> None:
        """Record one generation round: `keep[i]` says whether groups[i] is informative."""
        keep = [bool(k) for k in (keep.tolist() if isinstance(keep, torch.Tensor) else keep)]
        if len(keep) != len(groups):
            raise ValueError(f"{len(groups)} groups but {len(keep)} keep flags")
        if self.tries >= self.max_tries:
            raise DynamicSamplingError(f"DynamicSampler.add called after max_tries={self.max_tries} rounds")
        self.tries += 1
        self.seen += len(groups)
        self.kept.extend(g for g, k in zip(groups, keep) if k)
        if not self.done and self.tries >= self.max_tries:
            raise DynamicSamplingError(
                f"dynamic sampling kept {len(self.kept)}/{self.target_groups} groups after "
                f"{self.tries} rounds ({self.seen} groups generated; the rest were all-correct or "
                f"all-wrong). The task is too easy or too hard for the policy: raise "
                f"algorithm.max_sampling_tries, or turn off algorithm.dynamic_sampling.")

    def result(self) -> list[T]:
        """Exactly target_groups kept groups (the first ones to arrive)."""
        if not self.done:
            raise DynamicSamplingError(f"only {len(self.kept)}/{self.target_groups} groups collected so far")
        return self.kept[: self.target_groups]


def dynamic_sample(generate: Callable[[int], tuple[Sequence[T], Sequence[bool]]],
                   target_groups: int, max_tries: int) -> tuple[list[T], dict]:
    """Call generate(round) -> (groups, keep flags) until target_groups are kept.

    Returns (exactly target_groups groups, stats); raises DynamicSamplingError
    after max_tries rounds.
    """
    sampler: DynamicSampler[T] = DynamicSampler(target_groups, max_tries)
    while not sampler.done:
        groups, keep = generate(sampler.tries)
        sampler.add(groups, keep)
    stats = {"dapo/rounds": sampler.tries, "dapo/groups_seen": sampler.seen,
             "dapo/kept_fraction": len(sampler.kept) / max(1, sampler.seen)}
    return sampler.result(), stats


def overlong_penalty(response_lengths, max_len: int, buffer: int, penalty_factor: float) -> torch.Tensor:
    """DAPO soft overlong punishment, added to the reward.

    0 while length <= max_len - buffer, then linear down to -penalty_factor at
    max_len (clamped there). buffer=0 disables it.
    """
    lengths = torch.as_tensor(response_lengths, dtype=torch.float32)
    if buffer <= 0:
        return torch.zeros_like(lengths)
    if buffer > max_len:
        raise ValueError(f"overlong buffer {buffer} exceeds max_len {max_len}")
    exceed = lengths - (max_len - buffer)
    return (-exceed / buffer * penalty_factor).clamp(min=-penalty_factor, max=0.0)


__all__ = ["DynamicSamplingError", "dapo_keep_mask", "DynamicSampler", "dynamic_sample", "overlong_penalty"]
