"""RL losses against values computed by hand on tiny tensors.

The policy's train step with entropy_coef == 0: entropy is a metric only, computed without autograd
(nothing saved for a backward it never has), gradients unchanged; with entropy_coef > 0 its
term still has its gradient. The step's loss function runs as LearnerWorker._optimizer_step builds it,
on a leaf standing for the model's logits.
"""

from __future__ import annotations
import math
import pytest
import torch
from megatron_specrl.learner import losses as L
from functools import partial
from types import SimpleNamespace
from megatron_specrl.config import LossConfig
from megatron_specrl.learner.logprobs import token_logprobs
from megatron_specrl.learner.worker import LearnerWorker



# ---- RL losses against values computed by hand on tiny tensors.

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


def test_dual_clip_is_on_by_default_as_in_verl():
    """verl's clip_ratio_c = 3: log-ratio 2, A = -1 -> max(e^2, 1.2) = 7.39 capped at 3, zero gradient."""
    from megatron_specrl.config import LossConfig
    assert LossConfig().dual_clip_c == 3.0
    lp = t([[2.0]]).requires_grad_()
    old, adv, mask = t([[0.0]]), t([[-1.0]]), t([[1.0]])
    loss, m = L.policy_loss(lp, old, adv, mask)                    # the function's default: c = 3 too
    loss.backward()
    assert loss.item() == 3.0 and lp.grad.item() == 0.0 and m["pg_clipfrac_dual"].item() == 1.0
    batch = {"loss_mask": mask, "old_logprobs": old, "advantages": adv}
    lp.grad = None
    loss, _ = L.rl_policy_objective(lp, None, batch, LossConfig(tis="off"))
    loss.backward()
    assert loss.item() == 3.0 and lp.grad.item() == 0.0
    # explicitly off (dual_clip_c: null): the plain PPO clip, e^2 with gradient e^2
    lp.grad = None
    off, _ = L.policy_loss(lp, old, adv, mask, dual_clip_c=None)
    off.backward()
    assert off.item() == pytest.approx(math.exp(2)) and lp.grad.item() == pytest.approx(math.exp(2))
    with pytest.raises(ValueError, match="dual_clip_c"):
        L.policy_loss(lp, old, adv, mask, dual_clip_c=1.0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_log_ratio_is_clamped_to_20_before_exp(dtype):
    """Log-ratio 25, A = -1, dual clip off: verl's loss is e^20 (the ratio's log clamped to 20), not e^25."""
    lp = torch.tensor([[25.0]], dtype=dtype, requires_grad=True)
    old, adv, mask = (torch.tensor([[v]], dtype=dtype) for v in (0.0, -1.0, 1.0))
    loss, m = L.policy_loss(lp, old, adv, mask, 0.2, 0.2, dual_clip_c=None)
    loss.backward()
    assert math.isfinite(loss.item()) and loss.item() == pytest.approx(math.exp(20.0), rel=1e-6)
    assert lp.grad.item() == 0.0                                    # flat past the clamp
    assert m["ratio_mean"].item() == pytest.approx(math.exp(20.0), rel=1e-6)
    # and -25 -> e^-20 with A = +1: max(-e^-20, -0.8) = -e^-20
    low, _ = L.policy_loss(-lp.detach(), old, -adv, mask, 0.2, 0.2, dual_clip_c=None)
    assert low.item() == pytest.approx(-math.exp(-20.0), rel=1e-6)


def test_tis_log_ratio_is_clamped_too():
    mask = t([[1.0, 1.0]])
    w = L.tis_weights(t([[-30.0, 5.0]]), t([[-5.0, -20.0]]), mask, "token", cap=1e12)
    assert w[0].tolist() == pytest.approx([math.exp(-20.0), math.exp(20.0)])      # not e^-25, e^25
    w = L.tis_weights(t([[-15.0, -15.0]]), t([[0.0, 0.0]]), mask, "sequence", cap=2.0)
    assert w[0].tolist() == pytest.approx([math.exp(-20.0)] * 2)                  # sum -30 -> -20


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


def test_seq_mean_token_sum_norm_is_dr_grpo():
    """Dr. GRPO (verl's seq-mean-token-sum-norm): each sequence's token sum over one constant
    (loss_scale_factor, the max response length), averaged over sequences."""
    loss_mat = t([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = t([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert L.aggregate(loss_mat, mask, "seq-mean-token-sum-norm", loss_scale_factor=4).item() == \
        pytest.approx((6 / 4 + 4 / 4) / 2)
    # seq-mean-token-sum is the same without the constant (not Dr. GRPO: it scales with length)
    assert L.aggregate(loss_mat, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    with pytest.raises(ValueError, match="loss_scale_factor"):
        L.aggregate(loss_mat, mask, "seq-mean-token-sum-norm")
    # through the policy objective, with the factor from the config: A = 1 on every token, ratio 1
    from megatron_specrl.config import LossConfig
    lp = t([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    batch = {"loss_mask": mask, "old_logprobs": lp.clone(), "advantages": torch.ones_like(lp)}
    cfg = LossConfig(agg_mode="seq-mean-token-sum-norm", loss_scale_factor=8, tis="off")
    loss, _ = L.rl_policy_objective(lp, None, batch, cfg)
    assert loss.item() == pytest.approx(-(3 / 8 + 1 / 8) / 2)


def test_microbatch_sums_with_global_denominator_equal_full_batch():
    g = torch.Generator().manual_seed(0)
    loss_mat = torch.randn(6, 5, generator=g, dtype=torch.float64)
    mask = (torch.rand(6, 5, generator=g) > 0.3).double()
    for mode in L.AGG_MODES:
        full = L.aggregate(loss_mat, mask, mode, loss_scale_factor=7.0)
        d = L.aggregation_denominator(mask, mode)
        parts = sum(L.aggregate(loss_mat[i:i + 2], mask[i:i + 2], mode, denom=d, loss_scale_factor=7.0)
                    for i in range(0, 6, 2))
        assert parts.item() == pytest.approx(full.item())


def test_kl_estimators():
    """verl's names and meanings: kl/k1, abs, mse/k2, low_var_kl/k3 (clamped), d = logp - ref."""
    lp, ref = t([[math.log(0.5), math.log(0.25)]]), t([[math.log(0.25), math.log(0.5)]])
    ln2 = math.log(2)
    expected = {"kl": [ln2, -ln2], "abs": [ln2, ln2], "mse": [0.5 * ln2 ** 2, 0.5 * ln2 ** 2],
                # e^-d - 1 + d: d = ln 2 -> 0.5 - 1 + ln 2; d = -ln 2 -> 2 - 1 - ln 2
                "low_var_kl": [-0.5 + ln2, 1.0 - ln2]}
    for aliases, want in [(("kl", "k1"), expected["kl"]), (("abs",), expected["abs"]),
                          (("mse", "k2"), expected["mse"]), (("low_var_kl", "k3"), expected["low_var_kl"])]:
        for kind in aliases:
            assert L.kl_penalty(lp, ref, kind)[0].tolist() == pytest.approx(want), kind
    assert L.kl_penalty(lp, ref)[0].tolist() == pytest.approx(expected["low_var_kl"])   # verl's default
    # logp = -15, ref = -1: e^14 - 14 - 1 = 1.2e6 unclamped; verl's low_var_kl (and k3) clamp it to 10
    for kind in ("low_var_kl", "k3"):
        assert L.kl_penalty(t([[-15.0]]), t([[-1.0]]), kind).item() == 10.0
    # the exponent is clamped to +-20 first: no inf / nan even at absurd gaps, in fp32 too
    far = L.kl_penalty(torch.tensor([[-1000.0, 0.0]]), torch.tensor([[0.0, -1000.0]]), "low_var_kl")
    assert far[0].tolist() == [10.0, 10.0]
    with pytest.raises(ValueError, match="low_var_kl"):
        L.kl_penalty(lp, ref, "low-var")


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


VERL_GRPO_RECIPE = """\
# GRPO as verl's docs set it (verl key in brackets), written with verl's names and defaults
algorithm:
  name: grpo
learner:
  loss:
    clip_low: 0.2             # [actor.clip_ratio_low]
    clip_high: 0.28           # [actor.clip_ratio_high]
    dual_clip_c: 3.0          # [actor.clip_ratio_c]
    agg_mode: token-mean      # [actor.loss_agg_mode]
    kl_type: low_var_kl       # [actor.kl_loss_type]
    kl_coef: 0.001            # [actor.kl_loss_coef], use_kl_loss: true
    entropy_coef: 0.0         # [actor.entropy_coeff]
"""


def test_verl_grpo_recipe_gives_verls_loss(tmp_path):
    """Accepted as written; on a fixed batch the loss is verl's pg loss + kl_loss_coef * low_var_kl,
    both token-mean, computed here by hand from verl's definitions."""
    from megatron_specrl.config import load_config
    recipe = tmp_path / "verl-grpo.yaml"
    recipe.write_text(VERL_GRPO_RECIPE)
    lc = load_config(recipe).learner.loss
    assert (lc.clip_low, lc.clip_high, lc.dual_clip_c, lc.agg_mode, lc.kl_type, lc.kl_coef) == \
        (0.2, 0.28, 3.0, "token-mean", "low_var_kl", 0.001)
    ln = math.log
    # 2 sequences x 4 positions; the last position is padding (garbage values, masked)
    lp = t([[ln(0.6), ln(0.45), ln(0.3), 3.0], [ln(0.5), ln(0.2), -15.0, 7.0]])
    old = t([[ln(0.4), ln(0.5), ln(0.3), -9.0], [ln(0.1), ln(0.4), -15.0, -30.0]])
    ref = t([[ln(0.3), ln(0.45), ln(0.6), 1.0], [ln(0.25), ln(0.4), -1.0, 40.0]])
    adv = t([[1.0, 1.0, 1.0, 5.0], [-1.0, -1.0, -1.0, 5.0]])
    mask = t([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    batch = {"loss_mask": mask, "old_logprobs": old, "advantages": adv, "ref_logprobs": ref}
    loss, m = L.rl_policy_objective(lp, None, batch, lc)
    # per token, ratio r = pi / pi_old:
    #   A = +1: r = 1.5 -> max(-1.5, -1.28) = -1.28 (clip-high);  r = 0.9 -> -0.9;  r = 1 -> -1
    #   A = -1: r = 5 -> max(5, 1.28) = 5, dual clip min(5, 3) = 3;  r = 0.5 -> max(0.5, 0.8) = 0.8;  r = 1 -> 1
    pg = (-1.28 - 0.9 - 1.0 + 3.0 + 0.8 + 1.0) / 6
    # low_var_kl = r' - log r' - 1 with r' = pi_ref / pi, clamped to [-10, 10]:
    #   r' = 0.5, 1, 2 | 0.5, 2 -> ln2 - 0.5, 0, 1 - ln2 | ln2 - 0.5, 1 - ln2 (sum 1);  e^14 - 15 -> 10
    kl = (1.0 + 10.0) / 6
    assert m["pg_loss"].item() == pytest.approx(pg, abs=1e-12)
    assert m["kl"].item() == pytest.approx(kl, abs=1e-12)
    assert loss.item() == pytest.approx(pg + 0.001 * kl, abs=1e-12)
    assert m["pg_clipfrac"].item() == pytest.approx(2 / 6) and m["pg_clipfrac_dual"].item() == pytest.approx(1 / 6)


def test_value_loss_with_dr_grpo_aggregation_uses_the_scale_factor():
    """The critic aggregates like the policy: per sequence, token sum / loss_scale_factor, then the mean."""
    values = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])
    returns = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss, _ = L.value_loss(values, values.clone(), returns, mask, clip=10.0,
                           agg_mode="seq-mean-token-sum-norm", loss_scale_factor=4.0)
    # 0.5 * mean((1 + 4) / 4, 9 / 4) = 0.5 * 1.75
    assert loss.item() == pytest.approx(0.875)


# ---- The policy's train step with entropy_coef == 0: entropy is a metric only, computed without autograd

B, T, V_PADDED, V = 2, 6, 8, 7      # one padded vocab column


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.zeros(B, T)
    mask[0, 2:] = 1
    mask[1, 3:5] = 1
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask,
            "old_logprobs": -torch.rand(B, T, generator=g), "advantages": torch.zeros(B, T),   # A = 0: no pg grad
            "temperature": 1.0}, torch.randn(B, T, V_PADDED, generator=g)


def _train_step(entropy_coef: float):
    """LearnerWorker._optimizer_step's loss on leaf logits -> (logits' grad, metrics, saved-tensor bytes)."""
    batch, logits = _batch()
    logits.requires_grad_(True)
    saved = []

    def pack(x):
        saved.append(x.numel() * x.element_size())
        return x

    def run_schedule(mbs, loss_fn, forward_only):
        (mb,) = mbs
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            loss, reported = loss_fn(mb, logits)
        loss.backward()
        return [reported]

    w = SimpleNamespace(role="policy", hf_config=SimpleNamespace(vocab_size=V), ddp=None,
                        model=SimpleNamespace(config=SimpleNamespace(num_moe_experts=None)),
                        settings=SimpleNamespace(loss=LossConfig(entropy_coef=entropy_coef, tis="off"), dp=1),
                        _dp_rows=lambda rows: rows, _run_schedule=run_schedule,
                        _microbatches=lambda b, rows: [{**b, "rows": torch.tensor(rows)}],
                        optimizer=SimpleNamespace(zero_grad=lambda set_to_none: None, step=lambda: None),
                        _finalize_grads=lambda clip: 0.0, _reduce_metrics=lambda store, gn: store[0])
    w._heads = partial(LearnerWorker._heads, w)
    metrics = LearnerWorker._optimizer_step(w, batch, list(range(B)))
    return logits.grad, metrics, sum(saved)


def _reference_entropy(logits, mask):
    """Per-token entropy of the distribution that predicted token t (0 at t=0), from torch's own."""
    ent = torch.distributions.Categorical(logits=logits[:, :-1, :V]).entropy()
    return torch.cat([ent.new_zeros(B, 1), ent], dim=1)


def test_entropy_coef_zero_leaves_gradients_and_the_metric_unchanged_and_saves_less():
    grad, metrics, saved = _train_step(0.0)
    batch, logits = _batch()
    mask = batch["loss_mask"]
    # the gradient of the loss without entropy at all
    leaf = logits.clone().requires_grad_(True)
    lp, _ = token_logprobs(leaf, batch["input_ids"], V, with_entropy=False)
    loss, _ = L.rl_policy_objective(lp, None, batch, LossConfig(tis="off"), float(mask.sum()))
    loss.backward()
    assert torch.equal(grad, leaf.grad)
    expected = (_reference_entropy(logits, mask) * mask).sum() / mask.sum()
    assert float(metrics["entropy"]) == pytest.approx(float(expected), rel=1e-5)
    # saved for backward (counted per save): the entropy's product no longer saves its two
    # [B, T-1, V_local] float32 operands, exp(shifted) and the shifted logits. (Their storage is saved by
    # the log-prob's own graph too, by exp and gather in torch 2.x, so this is graph bookkeeping more
    # than memory.)
    _, _, saved_with_entropy_grad = _train_step(0.1)
    assert saved <= saved_with_entropy_grad - 2 * B * (T - 1) * V_PADDED * 4


def test_entropy_coef_positive_has_the_entropy_gradient():
    """A = 0, so the loss is -c * mean_t H_t; dH/dz_i = -p_i (log p_i + H) by hand."""
    c = 0.3
    grad, _, _ = _train_step(c)
    batch, logits = _batch()
    mask = batch["loss_mask"]
    logp = torch.log_softmax(logits[:, :-1, :V], dim=-1)
    p = logp.exp()
    H = -(p * logp).sum(-1, keepdim=True)
    expected = torch.zeros(B, T, V_PADDED)
    expected[:, :-1, :V] = c / mask.sum() * mask[:, 1:, None] * p * (logp + H)
    assert torch.allclose(grad, expected, atol=1e-6)


def test_decoupled_ppo_clips_against_the_proximal_policy_and_weights_by_the_behaviour_ratio():
    """trainer.max_staleness: the batch was generated by older weights (behaviour, the rollout's log-probs),
    the old log-probs are the learner's recomputed ones (proximal). AReaL's decoupled PPO is our loss with
    tis=token: the ratio is clipped against the proximal policy and each token weighted by
    min(pi_prox / pi_behav, tis_cap). By hand, A = 1, clip 0.2 / 0.2, cap 2:
      t1: r = 0.5/0.5 = 1,   w = min(0.5/0.2 = 2.5, 2) = 2   -> -1 x 2     = -2
      t2: r = 0.6/0.5 = 1.2, w = 0.5/0.5 = 1                 -> -1.2 x 1   = -1.2
      t3: r = 0.9/0.6 = 1.5, clipped to 1.2, w = 0.6/0.9     -> -1.2 x 2/3 = -0.8
    token-mean: -4/3."""
    log = torch.log
    lp = log(t([[0.5, 0.6, 0.9]]))
    prox = log(t([[0.5, 0.5, 0.6]]))
    behav = log(t([[0.2, 0.5, 0.9]]))
    adv, mask = torch.ones(1, 3), torch.ones(1, 3)
    loss, m = L.policy_loss(lp, prox, adv, mask, clip_low=0.2, clip_high=0.2, dual_clip_c=None,
                            rollout_logprobs=behav, tis="token", tis_cap=2.0)
    assert loss.item() == pytest.approx(-4 / 3, rel=1e-6)
    assert m["tis_mean"].item() == pytest.approx((2 + 1 + 2 / 3) / 3, rel=1e-6)
    # against the behaviour policy instead (no recompute): another loss, which is what staleness would bias
    stale, _ = L.policy_loss(lp, behav, adv, mask, clip_low=0.2, clip_high=0.2, dual_clip_c=None)
    assert stale.item() != pytest.approx(loss.item(), rel=1e-3)
