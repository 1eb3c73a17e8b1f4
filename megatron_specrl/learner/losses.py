"""RL losses as pure functions of [B, T] tensors (no model, no process groups).

All token matrices are aligned with input_ids and `mask` selects response tokens.
`denom` lets the caller aggregate a microbatch with the global denominator of the
whole mini-batch (across microbatches and data-parallel ranks), so the summed
gradients equal those of one big batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# KL estimator names, as in verl (kl_loss_type): each alias pair is one estimator.
KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
# Log-ratios (policy ratio, TIS weights, low_var_kl) are clamped to +-LOG_RATIO_CLAMP before exp, as in
# verl: exp(20) = 4.9e8 stays finite in fp32 and bf16, so one wild token cannot overflow the loss.
LOG_RATIO_CLAMP = 20.0


def aggregation_denominator(mask: Tensor, mode: str) -> float:
    """Tokens (token-mean) or sequences with at least one token (seq-mean-*)."""
    if mode == "token-mean":
        return float(mask.sum())
    if mode in ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        return float((mask.sum(-1) > 0).sum())
    raise ValueError(f"unknown agg_mode {mode!r}; choose one of {AGG_MODES}")


def aggregate(loss_mat: Tensor, mask: Tensor, mode: str = "token-mean", denom: float | None = None,
              loss_scale_factor: float | None = None) -> Tensor:
    """Reduce a [B, T] loss matrix to a scalar (verl's loss_agg_mode names and meanings).

    token-mean:               sum(loss * mask) / #tokens                      (DAPO; verl's default)
    seq-mean-token-sum:       mean over sequences of sum_t loss               (no length normalisation;
                              not Dr. GRPO: the loss scale grows with the response length)
    seq-mean-token-mean:      mean over sequences of mean_t loss              (original GRPO)
    seq-mean-token-sum-norm:  mean over sequences of sum_t loss / loss_scale_factor   (Dr. GRPO: one
                              constant, the max response length, instead of each sequence's length)

    verl's seq-mean-token-sum-norm leaves out the mean over sequences: its value is ours times
    ppo_micro_batch_size_per_gpu (legacy workers) or the sequences per DP rank (engine workers), and
    split-dependent with use_dynamic_bsz; ours keeps Dr. GRPO's 1/G, independent of the split (README).

    Sequences whose mask is all zero do not count in the seq-mean-* means. `denom`, when given,
    replaces aggregation_denominator(mask, mode) (a global one, so microbatches sum to the batch).
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
    elif mode == "seq-mean-token-sum-norm":
        if loss_scale_factor is None or not loss_scale_factor > 0:
            raise ValueError(f"agg_mode seq-mean-token-sum-norm needs loss_scale_factor > 0 (the constant each "
                             f"sequence's token sum is divided by), got {loss_scale_factor!r}")
        per_seq = per_seq / float(loss_scale_factor)
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"unknown agg_mode {mode!r}; choose one of {AGG_MODES}")
    return per_seq.sum() / denom


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1)


def tis_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, level: str, cap: float) -> Tensor:
    """Truncated importance weights min(pi_learner / pi_rollout, cap), detached.

    token: one weight per token; sequence: one per sequence (product over its tokens). The log of
    each weight is clamped to +-LOG_RATIO_CLAMP before exp (a NaN stays NaN).
    """
    log_ratio = (old_logprobs - rollout_logprobs).detach() * mask
    c = LOG_RATIO_CLAMP
    if level == "token":
        w = log_ratio.clamp(-c, c).exp()
    elif level == "sequence":
        w = log_ratio.sum(-1, keepdim=True).clamp(-c, c).exp().expand_as(log_ratio)
    else:
        raise ValueError(f"tis must be 'off', 'token' or 'sequence', got {level!r}")
    return w.clamp(max=cap)


def policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                clip_low: float = 0.2, clip_high: float = 0.2, dual_clip_c: float | None = 3.0,
                agg_mode: str = "token-mean", rollout_logprobs: Tensor | None = None, tis: str = "off",
                tis_cap: float = 2.0, denom: float | None = None,
                loss_scale_factor: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with asymmetric clip (DAPO clip-higher), dual clip and TIS (verl's definitions).

    r = exp(clamp(logprobs - old_logprobs, +-LOG_RATIO_CLAMP));
    loss_t = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)), and for A < 0 with dual clip
    (dual_clip_c = c > 1, verl's clip_ratio_c; None turns it off) min(that, -A c): a token whose
    ratio ran past c under a negative advantage costs at most c |A| and gets no gradient.
    """
    mask = mask.to(logprobs.dtype)
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(pg1, pg2)
    clipped = (pg2 > pg1).to(mask.dtype)
    dual = torch.zeros_like(mask)
    if dual_clip_c is not None:
        if not dual_clip_c > 1.0:
            raise ValueError(f"dual_clip_c must be > 1 (or None to turn the dual clip off), got {dual_clip_c}")
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
    loss = aggregate(loss_mat, mask, agg_mode, denom, loss_scale_factor)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean(clipped, mask),
            "pg_clipfrac_dual": masked_mean(dual, mask),
            "approx_kl": masked_mean(-log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
            "tis_mean": masked_mean(tis_w, mask) if tis_w is not None else torch.tensor(1.0),
        }
    return loss, metrics


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str = "low_var_kl") -> Tensor:
    """Per-token estimators of KL(pi || ref) (Schulman, "Approximating KL divergence"), with verl's
    names and meanings (actor.kl_loss_type); d = logprobs - ref_logprobs:

    kl / k1:          d                                  (unbiased, can be negative)
    abs:              |d|
    mse / k2:         d^2 / 2
    low_var_kl / k3:  clamp(e^-d - 1 + d, -10, 10), with -d clamped to +-20 before exp
                      (unbiased and >= 0 before the clamp; the clamp bounds its variance)
    """
    d = logprobs - ref_logprobs
    if kind in ("kl", "k1"):
        return d
    if kind == "abs":
        return d.abs()
    if kind in ("mse", "k2"):
        return 0.5 * d.square()
    if kind in ("low_var_kl", "k3"):
        log_r = (-d).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return (log_r.exp() - log_r - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"kl kind must be one of {KL_TYPES}, got {kind!r}")


def entropy_bonus(entropy: Tensor, mask: Tensor, agg_mode: str = "token-mean", denom: float | None = None,
                  loss_scale_factor: float | None = None) -> Tensor:
    """Aggregated entropy; the total loss subtracts entropy_coef times this."""
    return aggregate(entropy, mask, agg_mode, denom, loss_scale_factor)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float = 0.2,
               agg_mode: str = "token-mean", denom: float | None = None,
               loss_scale_factor: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped value loss: 0.5 * max((v - R)^2, (old + clip(v - old, +-clip) - R)^2)."""
    mask = mask.to(values.dtype)
    v_clip = old_values + (values - old_values).clamp(-clip, clip)
    l1 = (values - returns) ** 2
    l2 = (v_clip - returns) ** 2
    loss = 0.5 * aggregate(torch.maximum(l1, l2), mask, agg_mode, denom, loss_scale_factor)
    with torch.no_grad():
        metrics = {"vf_clipfrac": masked_mean((l2 > l1).to(mask.dtype), mask),
                   "value_mean": masked_mean(values, mask)}
    return loss, metrics


def rl_policy_objective(logprobs: Tensor, entropy: Tensor | None, batch: dict, loss_cfg,
                        denom: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """pg loss + kl_coef * KL - entropy_coef * entropy, configured by a LossConfig."""
    mask = batch["loss_mask"].to(logprobs.dtype)
    mode, scale = loss_cfg.agg_mode, loss_cfg.loss_scale_factor
    loss, metrics = policy_loss(
        logprobs, batch["old_logprobs"], batch["advantages"], mask, loss_cfg.clip_low, loss_cfg.clip_high,
        loss_cfg.dual_clip_c, mode, batch.get("rollout_logprobs"),
        loss_cfg.tis if batch.get("rollout_logprobs") is not None else "off", loss_cfg.tis_cap, denom, scale)
    metrics["pg_loss"] = loss.detach()
    if loss_cfg.kl_coef > 0 and batch.get("ref_logprobs") is not None:
        kl = aggregate(kl_penalty(logprobs, batch["ref_logprobs"], loss_cfg.kl_type), mask, mode, denom, scale)
        loss = loss + loss_cfg.kl_coef * kl
        metrics["kl"] = kl.detach()
    if entropy is not None:
        ent = entropy_bonus(entropy, mask, mode, denom, scale)
        if loss_cfg.entropy_coef != 0:
            loss = loss - loss_cfg.entropy_coef * ent
        metrics["entropy"] = ent.detach()
    return loss, metrics
