"""Advantage estimators: GRPO group baselines and PPO's GAE, as pure tensor functions.

Shapes: N = number of samples (responses); [B, T] = response tokens with a
0/1 mask marking real (non-padding) response tokens.
"""

from __future__ import annotations

import torch


def group_index(group_ids, n: int) -> tuple[torch.Tensor, int]:
    """Map arbitrary group ids (strings, ints, a tensor) to dense indices 0..G-1 in first-seen order."""
    ids = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    if len(ids) != n:
        raise ValueError(f"{len(ids)} group ids for {n} rewards")
    dense: dict = {}
    idx = torch.tensor([dense.setdefault(g, len(dense)) for g in ids], dtype=torch.long)
    return idx, len(dense)


def grpo_advantages(rewards: torch.Tensor, group_ids, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages: (r - mean_group) [/ (std_group + eps)].

    The std is the unbiased one (as verl). A group of one, or one whose rewards
    are all equal (max == min, compared exactly: the float32 mean of six rewards of
    0.3 is not exactly 0.3, so a std test would give them a spurious advantage),
    gets advantage exactly 0: it carries no preference between samples.
    normalize_std=False is Dr. GRPO's unbiased variant.
    """
    rewards = torch.as_tensor(rewards, dtype=torch.float32).flatten()
    idx, g = group_index(group_ids, rewards.numel())
    count = torch.zeros(g).index_add_(0, idx, torch.ones_like(rewards))
    mean = torch.zeros(g).index_add_(0, idx, rewards) / count
    centered = rewards - mean[idx]
    sq = torch.zeros(g).index_add_(0, idx, centered ** 2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    hi = torch.full((g,), -torch.inf).scatter_reduce_(0, idx, rewards, "amax")
    lo = torch.full((g,), torch.inf).scatter_reduce_(0, idx, rewards, "amin")
    degenerate = (count < 2) | (hi == lo)
    adv = centered / (std[idx] + eps) if normalize_std else centered
    return torch.where(degenerate[idx], torch.zeros_like(adv), adv)


def terminal_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] rewards that are 0 except `scores[b]` on the last unmasked token of row b."""
    mask = mask.to(torch.float32)
    out = torch.zeros_like(mask)
    lengths = mask.sum(-1).long()
    if (lengths == 0).any():
        raise ValueError("a response has no unmasked token to carry its reward")
    last = mask.shape[1] - 1 - torch.flip(mask, dims=[1]).argmax(dim=1)
    out[torch.arange(mask.shape[0]), last] = torch.as_tensor(scores, dtype=torch.float32)
    return out


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens -> (advantages, returns), both [B, T].

    delta_t = r_t + gamma * V_{t+1} - V_t and A_t = delta_t + gamma * lam * A_{t+1},
    where t+1 is the next *unmasked* token (masked positions are skipped, and the
    value after the last token is 0). Returns = A + V. Outputs are 0 where mask is 0;
    whitening is left to the caller (see whiten).
    """
    mask = mask.to(values.dtype)
    B, T = values.shape
    next_value = torch.zeros(B, dtype=values.dtype)
    next_adv = torch.zeros(B, dtype=values.dtype)
    adv = torch.zeros_like(values)
    for t in reversed(range(T)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = a * m
        next_adv = m * a + (1 - m) * next_adv
        next_value = m * values[:, t] + (1 - m) * next_value
    returns = (adv + values) * mask
    return adv, returns


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Normalise x to unit variance (and zero mean) over the unmasked entries; masked entries -> 0."""
    mask = mask.to(x.dtype)
    n = mask.sum()
    if n < 2:
        raise ValueError("whiten needs at least two unmasked entries")
    mean = (x * mask).sum() / n
    var = (((x - mean) ** 2) * mask).sum() / (n - 1)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask

