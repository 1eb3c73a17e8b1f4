"""Per-token log-probs and entropy from vocab-parallel logits, without gathering the vocab.

Each TP rank holds logits for a contiguous slice of the (padded) vocabulary. The
log-sum-exp, the target logit and the entropy term are reduced over the TP group
with Megatron's reduce_from_tensor_model_parallel_region (all-reduce forward,
identity backward), which is the correct gradient because the loss is replicated
across TP ranks. Padded vocabulary columns are excluded.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor


def _tp_info():
    from megatron.core import parallel_state as ps
    if ps.model_parallel_is_initialized():
        return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    return 0, 1


def _all_reduce_max(x: Tensor) -> Tensor:
    from megatron.core import parallel_state as ps
    _, tp = _tp_info()
    if tp > 1:
        torch.distributed.all_reduce(x, op=torch.distributed.ReduceOp.MAX,
                                     group=ps.get_tensor_model_parallel_group())
    return x


def _all_reduce_sum(x: Tensor) -> Tensor:
    _, tp = _tp_info()
    if tp == 1:
        return x
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
    return reduce_from_tensor_model_parallel_region(x)


def vocab_parallel_logprobs_entropy(logits: Tensor, targets: Tensor, true_vocab_size: int | None = None,
                                    temperature: float = 1.0, with_entropy: bool = True, entropy_grad: bool = True):
    """logits [..., V_local] (this rank's vocab slice), targets [...] global ids -> (logprob, entropy).

    entropy_grad=False: the entropy is a metric only (entropy_coef 0), computed without autograd, so its
    product does not keep the shifted logits ([..., V_local]) alive for a backward that never uses them
    (verl computes it under no_grad then too)."""
    tp_rank, _ = _tp_info()
    v_local = logits.shape[-1]
    start = tp_rank * v_local
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    valid = None
    if true_vocab_size is not None and start + v_local > true_vocab_size:
        valid = torch.arange(start, start + v_local, device=logits.device) < true_vocab_size
        logits = logits.masked_fill(~valid, -1e30)
    with torch.no_grad():
        gmax = _all_reduce_max(logits.max(dim=-1, keepdim=True)[0].clone())
    shifted = logits - gmax
    exp = shifted.exp()
    sum_exp = _all_reduce_sum(exp.sum(dim=-1))
    log_z = sum_exp.log()

    local_t = targets - start
    in_range = (local_t >= 0) & (local_t < v_local)
    picked = shifted.gather(-1, local_t.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = _all_reduce_sum(torch.where(in_range, picked, torch.zeros_like(picked)))
    logprob = target_logit - log_z

    entropy = None
    if with_entropy:
        with contextlib.nullcontext() if entropy_grad else torch.no_grad():
            term = exp * shifted
            if valid is not None:
                term = torch.where(valid, term, torch.zeros_like(term))
            entropy = log_z - _all_reduce_sum(term.sum(dim=-1)) / sum_exp
    return logprob, entropy


def token_logprobs(logits: Tensor, input_ids: Tensor, true_vocab_size: int | None = None,
                   temperature: float = 1.0, with_entropy: bool = True, entropy_grad: bool = True):
    """Logits [B, T, V_local] -> log p(input_ids[:, t] | <t) aligned with input_ids, 0 at t=0.

    Entropy at t is that of the distribution that predicted token t (also 0 at t=0).
    """
    lp, ent = vocab_parallel_logprobs_entropy(logits[:, :-1], input_ids[:, 1:], true_vocab_size,
                                              temperature, with_entropy, entropy_grad)
    pad = lp.new_zeros(lp.shape[0], 1)
    lp = torch.cat([pad, lp], dim=1)
    if ent is not None:
        ent = torch.cat([pad, ent], dim=1)
    return lp, ent
