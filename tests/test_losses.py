"""RL losses against values computed by hand on tiny tensors."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_specrl.learner import losses as L


def t(x):
    return torch.tensor(x, dtype=torch.float64)


def test_clip_higher_asymmetry():
    """A > 0: ratio capped at 1 + clip_high; A < 0: ratio floored at 1 - clip_low."""
    lp = t([[math.log(1.5), math.log(0.5)]])
    old = t([[0.0, 0.0]])
    mask = t([[1.0, 1.0]])
    adv_pos = t([[1.0, 1.0]])
    loss, m = L.policy_loss(lp, old, adv_pos, mask, clip_low=0.2, clip_high=0.28)
    # token 0: max(-1.5, -1.28) = -1.28 (clipped); token 1: max(-0.5, -0.8) = -0.5
    assert loss.item() == pytest.approx((-1.28 - 0.5) / 2)
    assert m["pg_clipfrac"].item() == pytest.approx(0.5)
    adv_neg = -adv_pos
    loss, m = L.policy_loss(lp, old, adv_neg, mask, clip_low=0.2, clip_high=0.28)
    # token 0: max(1.5, 1.28) = 1.5; token 1: max(0.5, 0.8) = 0.8 (clipped at 1 - 0.2)
    assert loss.item() == pytest.approx((1.5 + 0.8) / 2)
    # symmetric 0.2 would have clipped token 0 at 1.2 for A > 0
    sym, _ = L.policy_loss(lp, old, adv_pos, mask, clip_low=0.2, clip_high=0.2)
    assert sym.item() == pytest.approx((-1.2 - 0.5) / 2)


def test_dual_clip_bounds_negative_advantages():
    lp, old, mask = t([[math.log(5.0), math.log(2.0)]]), t([[0.0, 0.0]]), t([[1.0, 1.0]])
    adv = t([[-1.0, -1.0]])
    loss, m = L.policy_loss(lp, old, adv, mask, 0.2, 0.2, dual_clip_c=3.0)
    # token 0: max(5, 1.2) = 5 -> min(5, 3) = 3; token 1: max(2, 1.2) = 2 < 3
    assert loss.item() == pytest.approx((3.0 + 2.0) / 2)
    assert m["pg_clipfrac_dual"].item() == pytest.approx(0.5)
    # positive advantages are untouched by the dual clip
    pos, _ = L.policy_loss(lp, old, -adv, mask, 0.2, 0.2, dual_clip_c=3.0)
    assert pos.item() == pytest.approx(-1.2)


def test_aggregation_modes():
    loss_mat = t([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = t([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert L.aggregate(loss_mat, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert L.aggregate(loss_mat, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert L.aggregate(loss_mat, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    # an all-masked sequence does not count, and a global denominator is used as given
    mask2 = t([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    assert L.aggregate(loss_mat, mask2, "seq-mean-token-mean").item() == pytest.approx(2.0)
    assert L.aggregate(loss_mat, mask, "token-mean", denom=8).item() == pytest.approx(10 / 8)
    with pytest.raises(ValueError, match="agg_mode"):
        L.aggregate(loss_mat, mask, "mean")


def test_microbatch_sums_with_global_denominator_equal_full_batch():
    g = torch.Generator().manual_seed(0)
    loss_mat = torch.randn(6, 5, generator=g, dtype=torch.float64)
    mask = (torch.rand(6, 5, generator=g) > 0.3).double()
    for mode in L.AGG_MODES:
        full = L.aggregate(loss_mat, mask, mode)
        d = L.aggregation_denominator(mask, mode)
        parts = sum(L.aggregate(loss_mat[i:i + 2], mask[i:i + 2], mode, denom=d) for i in range(0, 6, 2))
        assert parts.item() == pytest.approx(full.item())


def test_kl_estimators():
    lp, ref = t([[math.log(0.5)]]), t([[math.log(0.25)]])
    assert L.kl_penalty(lp, ref, "k1").item() == pytest.approx(math.log(2))
    # k3: r = ref/pi = 0.5 -> r - 1 - log r = -0.5 + log 2
    assert L.kl_penalty(lp, ref, "k3").item() == pytest.approx(-0.5 + math.log(2))
    assert L.kl_penalty(lp, ref, "low-var").item() == pytest.approx(-0.5 + math.log(2))
    far = L.kl_penalty(t([[-30.0]]), t([[0.0]]), "low-var")
    assert far.item() == pytest.approx(10.0)  # clamped
    assert L.kl_penalty(t([[-30.0]]), t([[0.0]]), "k3").item() > 1e6


def test_tis_token_and_sequence():
    old = t([[math.log(0.5), math.log(0.9)]])
    rollout = t([[math.log(0.1), math.log(0.9)]])
    mask = t([[1.0, 1.0]])
    w_tok = L.tis_weights(old, rollout, mask, "token", cap=2.0)
    assert w_tok[0].tolist() == pytest.approx([2.0, 1.0])  # 5 capped to 2
    w_seq = L.tis_weights(old, rollout, mask, "sequence", cap=10.0)
    assert w_seq[0].tolist() == pytest.approx([5.0, 5.0])
    lp, adv = old.clone(), t([[1.0, 1.0]])
    loss, m = L.policy_loss(lp, old, adv, mask, 0.2, 0.2, rollout_logprobs=rollout, tis="token", tis_cap=2.0)
    assert loss.item() == pytest.approx((-2.0 - 1.0) / 2)
    assert m["tis_mean"].item() == pytest.approx(1.5)


def test_value_loss_clipped():
    values, old, ret = t([[1.0, 0.0]]), t([[0.0, 0.0]]), t([[2.0, 1.0]])
    mask = t([[1.0, 1.0]])
    loss, m = L.value_loss(values, old, ret, mask, clip=0.5)
    # token 0: max((1-2)^2, (0.5-2)^2) = 2.25; token 1: max(1, 1) = 1 -> 0.5 * mean
    assert loss.item() == pytest.approx(0.5 * (2.25 + 1.0) / 2)
    assert m["vf_clipfrac"].item() == pytest.approx(0.5)


def test_policy_objective_combines_terms():
    from megatron_specrl.config import LossConfig
    lp = t([[0.0, math.log(0.5)]])
    batch = {"loss_mask": t([[0.0, 1.0]]), "old_logprobs": lp.clone(), "advantages": t([[0.0, 2.0]]),
             "ref_logprobs": t([[0.0, math.log(0.25)]])}
    ent = t([[0.0, 0.7]])
    cfg = LossConfig(kl_coef=0.1, kl_type="k1", entropy_coef=0.01, tis="off")
    loss, m = L.rl_policy_objective(lp, ent, batch, cfg)
    assert loss.item() == pytest.approx(-2.0 + 0.1 * math.log(2) - 0.01 * 0.7)
    assert m["kl"].item() == pytest.approx(math.log(2))
