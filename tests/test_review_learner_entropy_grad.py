"""The policy's train step with entropy_coef == 0: entropy is a metric only, computed without autograd
(nothing saved for a backward it never has), gradients unchanged; with entropy_coef > 0 its
term still has its gradient. The step's loss function runs as LearnerWorker._optimizer_step builds it,
on a leaf standing for the model's logits."""

from functools import partial
from types import SimpleNamespace

import pytest
import torch

from megatron_specrl.config import LossConfig
from megatron_specrl.learner import losses as L
from megatron_specrl.learner.logprobs import token_logprobs
from megatron_specrl.learner.worker import LearnerWorker

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
