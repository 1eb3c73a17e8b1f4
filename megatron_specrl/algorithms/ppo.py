"""PPO's advantages: critic values on the rollout batch, terminal task reward, GAE, whitening."""

from __future__ import annotations

import torch

from megatron_specrl.algorithms.advantages import gae, whiten


def terminal_rewards(loss_mask: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """[B, T] with each sample's reward on its last response token (the EOS when there is one)."""
    token_rewards = torch.zeros_like(loss_mask)
    positions = torch.arange(loss_mask.shape[1]).expand_as(loss_mask)
    last = torch.where(loss_mask > 0, positions, torch.full_like(positions, -1)).max(dim=1).values
    rows = torch.nonzero(last >= 0).squeeze(1)
    token_rewards[rows, last[rows]] = rewards[rows].to(token_rewards.dtype)
    return token_rewards


def ppo_advantages(run, batch: dict, rewards: torch.Tensor) -> dict[str, float]:
    """Fills batch['advantages'], ['returns'], ['old_values'] in place; returns metrics."""
    mask = batch["loss_mask"]
    values = run.critic.compute_values(batch) * mask
    adv, returns = gae(terminal_rewards(mask, rewards), values, mask, run.cfg.algorithm.gamma, run.cfg.algorithm.lam)
    batch["advantages"] = whiten(adv, mask) * mask
    batch["returns"] = returns * mask
    batch["old_values"] = values
    n = mask.sum().clamp(min=1)
    return {"critic/value_mean": float(values.sum() / n), "critic/return_mean": float((returns * mask).sum() / n)}
