"""RL losses as pure functions of [B, T] tensors (no model, no process groups).

All token matrices are aligned with input_ids and `mask` selects response tokens.
`denom` lets the caller aggregate a microbatch with the global denominator of the
whole mini-batch (across microbatches and data-parallel ranks), so the summed
gradients equal those of one big batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def aggregation_denominator(mask: Tensor, mode: str) -> float:
    """Tokens (token-mean) or sequences with at least one token (seq-mean-*)."""
    if mode == "token-mean":
        return float(mask.sum())
    if mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        return float((mask.sum(-1) > 0).sum())
    raise ValueError(f"unknown agg_mode {mode!r}; choose one of {AGG_MODES}")


def aggregate(loss_mat: Tensor, mask: Tensor, mode: str = "token-mean", denom: float | None = None) -> Tensor:
    """Reduce a [B, T] loss matrix to a scalar.

    token-mean:           sum(loss * mask) / #tokens
    seq-mean-token-sum:   mean over sequences of sum_t loss          (Dr. GRPO style)
    seq-mean-token-mean:  mean over sequences of mean_t loss         (original GRPO)
    """
    mask = mask.to(loss_mat.dtype)
    if denom is None:
        denom = aggregation_denominator(mask, mode)
    denom = max(float(denom), 1.0)
    if mode == "token-mean":
        return (loss_mat * mask).sum() / denom
    per_seq = (loss_mat * mask).sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(-1).clamp(min=1)
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"unknown agg_mode {mode!r}; choose one of {AGG_MODES}")
    return per_seq.sum() / denom


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1)


def tis_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, level: str, cap: float) -> Tensor:
    """Truncated importance weights min(pi_learner / pi_rollout, cap), detached.

    token: one weight per token; sequence: one per sequence (product over its tokens).
    """
    log_ratio = (old_logprobs - rollout_logprobs).detach() * mask
    if level == "token":
        w = log_ratio.exp()
    elif level == "sequence":
        w = log_ratio.sum(-1, keepdim=True).exp().expand_as(log_ratio)
    else:
        raise ValueError(f"tis must be 'off', 'token' or 'sequence', got {level!r}")
    return w.clamp(max=cap)


def policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                clip_low: float = 0.2, clip_high: float = 0.2, dual_clip_c: float | None = None,
                agg_mode: str = "token-mean", rollout_logprobs: Tensor | None = None, tis: str = "off",
                tis_cap: float = 2.0, denom: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with asymmetric clip (DAPO clip-higher), dual clip and TIS.

    loss_t = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)); for A < 0 with dual clip,
    min(that, -A c). r = exp(logprobs - old_logprobs).
    """
    mask = mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs
    ratio = log_ratio.exp()
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(pg1, pg2)
    clipped = (pg2 > pg1).to(mask.dtype)
    dual = torch.zeros_like(mask)
    if dual_clip_c is not None:
        pg3 = -advantages * dual_clip_c
        use_dual = (advantages < 0) & (loss_mat > pg3)
        loss_mat = torch.where(advantages < 0, torch.minimum(loss_mat, pg3), loss_mat)
        dual = use_dual.to(mask.dtype)
    tis_w = None
    if tis != "off":
        if rollout_logprobs is None:
            raise ValueError("tis != 'off' needs rollout_logprobs")
        tis_w = tis_weights(old_logprobs, rollout_logprobs, mask, tis, tis_cap)
        loss_mat = loss_mat * tis_w
    loss = aggregate(loss_mat, mask, agg_mode, denom)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean(clipped, mask),
            "pg_clipfrac_dual": masked_mean(dual, mask),
            "approx_kl": masked_mean(-log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
            "tis_mean": masked_mean(tis_w, mask) if tis_w is not None else torch.tensor(1.0),
        }
    return loss, metrics


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str = "low-var") -> Tensor:
    """Per-token KL(pi || ref) estimators (Schulman): k1 = log r; k3 = r' - 1 - log r', r' = ref/pi.

    low-var is k3 clamped to [-10, 10] (as in verl/GRPO), which bounds its variance.
    """
    if kind == "k1":
        return logprobs - ref_logprobs
    log_r = ref_logprobs - logprobs
    if kind == "k3":
        return log_r.exp() - log_r - 1.0
    if kind == "low-var":
        log_r = log_r.clamp(-20.0, 20.0)
        return (log_r.exp() - log_r - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"kl kind must be k1, k3 or low-var, got {kind!r}")


def entropy_bonus(entropy: Tensor, mask: Tensor, agg_mode: str = "token-mean", denom: float | None = None) -> Tensor:
    """Aggregated entropy; the total loss subtracts entropy_coef times this."""
    return aggregate(entropy, mask, agg_mode, denom)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float = 0.2,
               agg_mode: str = "token-mean", denom: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped value loss: 0.5 * max((v - R)^2, (old + clip(v - old, +-clip) - R)^2)."""
    mask = mask.to(values.dtype)
    v_clip = old_values + (values - old_values).clamp(-clip, clip)
    l1 = (values - returns) ** 2
    l2 = (v_clip - returns) ** 2
    loss = 0.5 * aggregate(torch.maximum(l1, l2), mask, agg_mode, denom)
    with torch.no_grad():
        metrics = {"vf_clipfrac": masked_mean((l2 > l1).to(mask.dtype), mask),
                   "value_mean": masked_mean(values, mask)}
    return loss, metrics


def rl_policy_objective(logprobs: Tensor, entropy: Tensor | None, batch: dict, loss_cfg,
                        denom: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """pg loss + kl_coef * KL - entropy_coef * entropy, configured by a LossConfig."""
    mask = batch["loss_mask"].to(logprobs.dtype)
    loss, metrics = policy_loss(
        logprobs, batch["old_logprobs"], batch["advantages"], mask, loss_cfg.clip_low, loss_cfg.clip_high,
        loss_cfg.dual_clip_c, loss_cfg.agg_mode, batch.get("rollout_logprobs"),
        loss_cfg.tis if batch.get("rollout_logprobs") is not None else "off", loss_cfg.tis_cap, denom)
    metrics["pg_loss"] = loss.detach()
    if loss_cfg.kl_coef > 0 and batch.get("ref_logprobs") is not None:
        kl = aggregate(kl_penalty(logprobs, batch["ref_logprobs"], loss_cfg.kl_type), mask, loss_cfg.agg_mode, denom)
        loss = loss + loss_cfg.kl_coef * kl
        metrics["kl"] = kl.detach()
    if entropy is not None:
        ent = entropy_bonus(entropy, mask, loss_cfg.agg_mode, denom)
        if loss_cfg.entropy_coef != 0:
            loss = loss - loss_cfg.entropy_coef * ent
        metrics["entropy"] = ent.detach()
    return loss, metrics
