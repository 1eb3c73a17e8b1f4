"""Process groups for the learner: torch.distributed (gloo on CPU, nccl on GPU) + Megatron TP/PP/DP."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def apply_cpu_patches() -> bool:
    """Install the CPU shims of megatron_specrl.patches (the repository's patches/) when CUDA is
    absent; no-op on GPUs."""
    if torch.cuda.is_available():
        return False
    from megatron_specrl import patches
    return patches.apply()


def cuda_to_cpu():
    """Scoped device="cuda" -> CPU rewrite around Megatron's schedules (null context on GPUs)."""
    if torch.cuda.is_available():
        import contextlib
        return contextlib.nullcontext()
    apply_cpu_patches()
    from megatron_specrl import patches
    return patches.cuda_to_cpu()


def init_distributed(rank: int, world_size: int, master_addr: str = "127.0.0.1", master_port: int = 29500,
                     tp: int = 1, pp: int = 1, seed: int = 1, timeout_s: float = 600.0, ep: int = 1) -> None:
    """Join the default group and build Megatron's model-parallel groups (DP = world / (tp*pp); the
    experts of an MoE model over `ep` ranks of each DP group, expert TP = tp)."""
    from megatron.core import parallel_state as ps

    if world_size % (tp * pp):
        raise ValueError(f"world_size={world_size} is not divisible by tp*pp={tp * pp}")
    cuda = torch.cuda.is_available()
    if not cuda:
        apply_cpu_patches()
    else:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", master_addr)
        os.environ.setdefault("MASTER_PORT", str(master_port))
        dist.init_process_group(backend="nccl" if cuda else "gloo", init_method=f"tcp://{master_addr}:{master_port}",
                                rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    if not ps.model_parallel_is_initialized():
        if (world_size // (tp * pp)) % ep:
            raise ValueError(f"learner.ep={ep} does not divide the data-parallel size {world_size // (tp * pp)}")
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep, expert_tensor_parallel_size=tp)
    seed_everything(seed)


def seed_everything(seed: int) -> None:
    """Same default seed on every rank + Megatron's per-TP-rank tracker (CPU tracker when no CUDA)."""
    from megatron.core import tensor_parallel
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy() -> None:
    from megatron.core import parallel_state as ps
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
