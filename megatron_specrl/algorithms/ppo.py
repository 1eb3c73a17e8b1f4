"""PPO's advantages: critic values on the rollout batch, token rewards, GAE, whitening."""

from __future__ import annotations

import torch

from megatron_specrl.algorithms.advantages import gae, whiten


def ppo_advantages(critic, batch: dict, token_rewards: torch.Tensor, gamma: float, lam: float) -> dict[str, float]:
    """Fills batch['advantages'], ['returns'], ['old_values'] in place; returns metrics.
    `critic`: anything with compute_values(batch) -> [B, T] (the critic's LearnerGroup);
    `token_rewards`: [B, T] like the batch (advantages.terminal_rewards of the task rewards, less the
    KL in the reward where it is on)."""
    mask = batch["loss_mask"]
    values = critic.compute_values(batch) * mask
    adv, returns = gae(token_rewards * mask, values, mask, gamma, lam)
    batch["advantages"] = whiten(adv, mask) * mask
    batch["returns"] = returns * mask
    batch["old_values"] = values
    n = mask.sum().clamp(min=1)
    # verl's names for the rollout batch's values and returns; `critic/value_mean` is the critic's
    # train step's (its values during the update), which the step logs beside these
    return {"critic/values/mean": float(values.sum() / n), "critic/returns/mean": float((returns * mask).sum() / n)}
