"""The learner's two optimizer paths, which give the same weights (tests/integration/learner/
test_distributed_optimizer.py):

- torch AdamW over the local shards, replicated on every DP rank (learner.distributed_optimizer off):
  our own gradient sync (tied embeddings over PP, a DP all-reduce that sums: the losses use global
  denominators) and global-norm clipping (`finalize_grads`), then `adamw_step`;
- Megatron's DistributedDataParallel + distributed Adam (on: moments sharded over the DP ranks;
  megatron_optim.py builds and steps it, CPU shims in patches/), driven by `megatron_step`.

A non-finite gradient norm skips the step on both and raises (AdamW would turn every weight NaN)."""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist

NONFINITE = ("non-finite gradients (grad norm {}): the optimizer step was skipped (a NaN / inf reward, "
             "advantage or log-prob in the batch?)")


def trainable(model) -> list[torch.nn.Parameter]:
    """The parameters an optimizer steps (a frozen reference has none)."""
    return [p for p in model.parameters() if p.requires_grad]


def build(model, f16, settings):
    """(Megatron DDP wrapper or None, optimizer) for one learner rank's model (`f16`: its Float16Module
    under learner.precision=bfloat16, which Megatron's DDP wraps instead)."""
    if settings.distributed_optimizer:
        from megatron_specrl.learner import megatron_optim
        return megatron_optim.build(f16 if f16 is not None else model, settings)
    return None, torch.optim.AdamW(trainable(model), lr=settings.lr,
                                   weight_decay=settings.weight_decay, betas=(0.9, 0.999), eps=1e-8)


def cpu_shims(ddp):
    """Scoped CUDA -> CPU rewrites around Megatron calls: the schedules', plus DDP's and the
    optimizer's with Megatron's optimizer (`ddp` not None); null contexts on GPUs."""
    if ddp is not None:
        from megatron_specrl.learner.megatron_optim import on_cpu
        return on_cpu()
    from megatron_specrl.learner.parallel import cuda_to_cpu
    return cuda_to_cpu()


def set_lr(optimizer, settings, train_steps: int) -> float:
    """This training step's lr (learner.lr_warmup_steps, verl's constant schedule with warm-up), set
    on every parameter group of either optimizer (Megatron's scheduler sets its groups so too)."""
    s = settings
    lr = s.lr * min(1.0, train_steps / s.lr_warmup_steps) if s.lr_warmup_steps else s.lr
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


# -- torch AdamW --------------------------------------------------------------------------
def adamw_step(optimizer, run_schedule: Callable[[], list], finalize_grads: Callable[..., float],
               step: bool) -> tuple[list, float]:
    """(the schedule's per-microbatch metrics, grad norm): gradients of run_schedule(), synced and
    clipped by finalize_grads, then (with `step`) the update."""
    optimizer.zero_grad(set_to_none=False)
    store = run_schedule()
    grad_norm = finalize_grads(clip=step)
    if step:
        if not math.isfinite(grad_norm):   # AdamW would turn every weight NaN; as Megatron's: skip, raise
            optimizer.zero_grad(set_to_none=False)
            raise RuntimeError(NONFINITE.format(grad_norm))
        optimizer.step()
    return store, grad_norm


def _sum_grads(params: list, group) -> None:
    """Sum the parameters' gradients over `group` in one all-reduce of their flattened concatenation."""
    grads = [p.grad for p in params]
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    for g, f in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(f)


def finalize_grads(params: list, model, settings, ps, device, world_size: int, clip: bool = True) -> float:
    """Tied-embedding grad sync (PP), DP all-reduce (sum: losses use global denominators), clip;
    returns the global norm (`ps`: megatron.core.parallel_state)."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if (settings.pp > 1 and getattr(model, "share_embeddings_and_output_weights", False)
            and ps.is_rank_in_embedding_group()):
        w = model.shared_embedding_or_output_weight()
        dist.all_reduce(w.grad, group=ps.get_embedding_group())
    # Replicated over TP but fed a TP rank's part: the per-head q / k norms (each rank holds its heads)
    # and, under sequence parallelism, the norms and the router (each rank its part of the sequence).
    # Megatron's finalize_model_grads sums these over TP; so does this path.
    partial_over_tp = [p for n, p in model.named_parameters() if p.requires_grad
                       and ("q_layernorm" in n or "k_layernorm" in n or getattr(p, "sequence_parallel", False))]
    if partial_over_tp and settings.tp > 1:
        _sum_grads(partial_over_tp, ps.get_tensor_model_parallel_group())
    # Expert-parallel experts (Megatron marks them allreduce=False) already hold the gradient of every
    # token their EP group routed to them: they sum over the expert-data-parallel ranks only.
    dense = [p for p in params if getattr(p, "allreduce", True)]
    experts = [p for p in params if not getattr(p, "allreduce", True)]
    for group_params, group in ((dense, ps.get_data_parallel_group), (experts, ps.get_expert_data_parallel_group)):
        if group_params and dist.get_world_size(group()) > 1:
            _sum_grads(group_params, group())
    dense_sq = torch.zeros(1, dtype=torch.float32, device=device)
    expert_sq = torch.zeros(1, dtype=torch.float32, device=device)
    for p in params:
        if param_is_not_tensor_parallel_duplicate(p) and not getattr(p, "shared", False):
            (dense_sq if getattr(p, "allreduce", True) else expert_sq).add_(p.grad.float().pow(2).sum())
    if world_size > 1:
        dist.all_reduce(dense_sq, group=ps.get_model_parallel_group())
        if ps.get_expert_model_parallel_world_size() > 1:   # experts differ over EP ranks: sum over ETP x EP x PP
            dist.all_reduce(expert_sq, group=ps.get_expert_tensor_model_pipeline_parallel_group())
    norm = float((dense_sq + expert_sq).sqrt())
    max_norm = settings.grad_clip
    if clip and max_norm and norm > max_norm and math.isfinite(norm):
        for p in params:
            p.grad.mul_(max_norm / (norm + 1e-6))
    return norm


# -- Megatron DDP + distributed optimizer -------------------------------------------------
def megatron_step(ddp, optimizer, params: list, run_schedule: Callable[[], list], cpu_shims: Callable,
                  step: bool) -> tuple[list, float]:
    """Megatron DDP + optimizer: grads accumulate in DDP's buffer, finalize_model_grads reduces
    them over DP (reduce-scatter with the distributed optimizer; all-reduce without a step, so
    that every rank holds full gradients for iter_hf_state(grads=True)) and ties embeddings
    across PP; megatron_optim.step() computes the global norm once, checks it, clips by it, updates
    this rank's shard and all-gathers the parameters. `cpu_shims`: the worker's scoped CUDA -> CPU
    rewrites (a null context on GPUs)."""
    from megatron.core.distributed import finalize_model_grads

    from megatron_specrl.learner import megatron_optim
    for p in params:
        p.grad = None
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    ddp.force_all_reduce = not step      # overlapped reduce: all-reduce instead of reduce-scatter
    try:
        store = run_schedule()
    finally:
        ddp.force_all_reduce = False
    with cpu_shims():
        finalize_model_grads([ddp], force_all_reduce=not step)
        if step:
            # Megatron's step() would step Adam on NaN gradients (fp32: no loss scaler to find them):
            # megatron_optim.step checks the global norm (the same on every rank: all raise) before
            # the update, and clips by that norm instead of computing it a second time.
            ok, grad_norm = megatron_optim.step(optimizer)
            if not math.isfinite(grad_norm):
                raise RuntimeError(NONFINITE.format(grad_norm))
            if not ok:
                raise RuntimeError("Megatron's optimizer skipped the step (non-finite gradients)")
        else:
            for p in params:
                if p.dtype == p.main_grad.dtype:    # bf16 params: iter_hf_state reads main_grad
                    p.grad = p.main_grad.detach().clone()
            optimizer.prepare_grads()
            grad_norm = optimizer.get_grad_norm()
    return store, float(grad_norm)


def reload_main_params(ddp, optimizer, bf16: bool) -> None:
    """bf16: copy the model's parameters into the optimizer's fp32 master weights (Megatron's
    reload_model_params, as Megatron-LM after loading weights without optimizer state); the fp32
    path's master weights are the parameters themselves, and a reference has no optimizer."""
    if bf16 and optimizer is not None:
        with cpu_shims(ddp):
            optimizer.reload_model_params()


def ensure_state(ddp, optimizer, params: list) -> None:
    """Materialise the optimizer's state (AdamW: zeros) so that loading a checkpoint has tensors to fill."""
    if ddp is not None:
        from megatron_specrl.learner.megatron_optim import ensure_state as ensure_megatron_state
        return ensure_megatron_state(optimizer)
    for p in params:
        st = optimizer.state[p]
        if not st:
            st["step"] = torch.tensor(0.0)
            st["exp_avg"] = torch.zeros_like(p)
            st["exp_avg_sq"] = torch.zeros_like(p)
