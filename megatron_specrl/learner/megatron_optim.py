"""Megatron's DistributedDataParallel + (distributed) optimizer for the learner (`learner.distributed_optimizer`).

With the flag on, the learner's GPTModel is wrapped in megatron.core's DistributedDataParallel
(contiguous fp32 gradient buffer, DP reduce-scatter) and stepped by get_megatron_optimizer's Adam
with use_distributed_optimizer=True: each data-parallel rank keeps the Adam moments of its
1/dp slice of the parameters, updates that slice, and all-gathers the parameters. Off, the
learner keeps its replicated torch AdamW (worker.py).

Equivalence with the replicated path (tests/integration/learner/test_distributed_optimizer.py):
- gradients: the losses use global denominators, so DP gradients are *summed*; Megatron's DDP
  averages (scales by 1/dp before a sum-reduce), so the learner multiplies its loss by dp
  (`loss_scale`);
- weight decay on every parameter like torch AdamW (config_overrides={}: no Megatron default
  that skips biases and norms), the same betas / eps, Megatron's global-norm clip (same
  max_norm / (norm + 1e-6) coefficient), by a norm computed once per step (`step`).

CPU (gloo): Megatron hard-codes CUDA in DDP and the optimizers; `on_cpu()` is the scoped shim of
patches/megatron_core_0_16_1_cpu.py (a null context on GPUs). The same DDP settings run on CPU
and GPU (ddp_config), so the CPU tests cover the GPU path's logic.

Checkpoints: the optimizer's sharded_state_dict in Megatron's 'fully_reshardable' format
(canonical per-parameter moments, resharded by dist_checkpointing across TP / PP / DP).
"""

from __future__ import annotations

import contextlib
import math

import torch

# Megatron's resharding format for the distributed optimizer (any TP / PP / DP on load).
SHARDING_TYPE = "fully_reshardable"


def on_cpu():
    """Scoped CPU shims for DDP / optimizer calls; null context where CUDA is present."""
    if torch.cuda.is_available():
        return contextlib.nullcontext()
    from megatron_specrl.learner.parallel import apply_cpu_patches
    apply_cpu_patches()
    from megatron_specrl import patches
    return patches.megatron_optimizer_on_cpu()


def ddp_config(distributed_optimizer: bool = True):
    """Gradient reduce overlapped with the backward (async collectives, on gloo too; the schedule
    holds it back until the last microbatch through config.no_sync_func). The parameter all-gather
    is not overlapped: the learner reads its weights right after a step (resync, export), before
    any forward would wait for an overlapped gather."""
    from megatron.core.distributed import DistributedDataParallelConfig
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=True,
        overlap_param_gather=False,
        use_distributed_optimizer=distributed_optimizer,
        check_for_nan_in_grad=False,
    )


def optimizer_config(settings, distributed_optimizer: bool = True, dtype: torch.dtype = torch.float32):
    from megatron.core.optimizer import OptimizerConfig
    return OptimizerConfig(
        optimizer="adam", lr=settings.lr, min_lr=settings.lr, weight_decay=settings.weight_decay,
        adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, clip_grad=settings.grad_clip,
        use_distributed_optimizer=distributed_optimizer,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
    )


def build(model, settings, distributed_optimizer: bool = True):
    """(DDP-wrapped model, Megatron optimizer) for one model chunk. The bare model stays usable:
    DDP keeps its parameters (their .data become views into DDP's buffers)."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import get_megatron_optimizer
    dtype = next(model.parameters()).dtype
    with on_cpu():
        ddp = DistributedDataParallel(model.config, ddp_config(distributed_optimizer), model)
        model.config.no_sync_func = ddp.no_sync          # grads reduce once, after the last microbatch
        opt = get_megatron_optimizer(optimizer_config(settings, distributed_optimizer, dtype), [ddp],
                                     config_overrides={})
    return ddp, opt


def step(optimizer) -> tuple[bool, float]:
    """(stepped, global grad norm): optimizer.step() with a finiteness check between the norm and the
    update, computing the norm once.

    Megatron's optimizer finds inf / NaN only through an fp16 loss scaler; with the learner's fp32
    parameters its step() clips by a NaN norm (a no-op), steps Adam on the NaN gradients and reports
    success, so the learner must see the norm before the update. Calling get_grad_norm() and then
    step() computed it twice (two passes over the gradients and two all-reduces, and prepare_grads'
    copy of the gradients twice); this is ChainedOptimizer.step() of megatron-core 0.16.1 (what
    get_megatron_optimizer returns) with the check inserted: prepare_grads, get_grad_norm, the clip by
    that norm, step_with_ready_grads. Not stepped: (False, norm) for a non-finite norm, (False, nan)
    when a loss scaler found inf / NaN; gradients are left as they are (the next step zeroes them)."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
    if optimizer.prepare_grads():
        return False, float("nan")
    grad_norm = optimizer.get_grad_norm()
    if not math.isfinite(grad_norm):
        return False, grad_norm
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(opt, "is_stub_optimizer", False):
            continue
        params = opt.get_parameters()
        if params and opt.config.clip_grad > 0.0:
            clip_grad_by_total_norm_fp32(params, max_norm=opt.config.clip_grad, total_norm=grad_norm,
                                         use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    return optimizer.step_with_ready_grads(), grad_norm


def inner_optimizers(optimizer) -> list:
    """The torch optimizers under Megatron's (Chained)Optimizer."""
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o.optimizer for o in chained]


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of optimizer state tensors (Adam moments) this rank holds."""
    total = 0
    for opt in inner_optimizers(optimizer):
        for st in opt.state.values():
            total += sum(v.numel() * v.element_size() for v in st.values()
                         if isinstance(v, torch.Tensor) and v.dim() > 0)
    return total


def adam_step_count(optimizer) -> int:
    """Adam's step counter: torch Adam's per-parameter one, else TE / apex FusedAdam's in the groups."""
    for opt in inner_optimizers(optimizer):
        for st in opt.state.values():
            if "step" in st:
                return int(st["step"])
        for g in opt.param_groups:
            if g.get("step") is not None:
                return int(g["step"])
    return 0


def ensure_state(optimizer) -> None:
    """Materialise Adam state (zero moments, step 0) before a checkpoint save or load: torch's Adam
    creates it lazily, and Megatron's DistributedOptimizer.state_dict() needs one step count per
    parameter when TE / apex (whose Adam keeps the step in the param groups) are absent. Other
    optimizers (TE / apex FusedAdam on GPUs) get Megatron's own init_state_fn (moments, no step)."""
    for wrapper in getattr(optimizer, "chained_optimizers", [optimizer]):
        opt = wrapper.optimizer
        if not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
            if getattr(wrapper, "init_state_fn", None) is not None:
                wrapper.init_state_fn(opt, wrapper.config)
            continue
        for group in opt.param_groups:
            for p in group["params"]:
                st = opt.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0)
                    st["exp_avg"] = torch.zeros_like(p.data)
                    st["exp_avg_sq"] = torch.zeros_like(p.data)


def load_state_dict(optimizer, state_dict) -> None:
    """optimizer.load_state_dict, then one Adam step tensor per parameter.

    With torch's Adam (no TE / apex: CPU), DistributedOptimizer.load_state_dict (megatron-core
    0.16.1) gives every parameter's state the *same* "step" tensor, and torch's Adam increments each
    parameter's step in place, so the shared counter would advance once per parameter per step and
    the bias correction of every step after a resume would be wrong (tests/integration/learner/test_distributed_optimizer.py
    catches it as a resumed step that differs from the uninterrupted one). The loader's copy itself
    needs torch Adam's step held out (patches/megatron_core_0_16_1_torch_adam_load.py), on GPUs too."""
    from megatron_specrl.patches.megatron_core_0_16_1_torch_adam_load import torch_adam_step_held_out
    with torch_adam_step_held_out():
        optimizer.load_state_dict(state_dict)
    for opt in inner_optimizers(optimizer):
        for st in opt.state.values():
            if isinstance(st.get("step"), torch.Tensor):
                st["step"] = st["step"].clone()
