"""Which weight transport a run uses: `trainer.resync_transport` resolved against the placement.

auto: no GPUs -> ray (object store; broadcast also runs on CPU but gains nothing there, see README);
colocated on GPUs -> cuda_ipc (the engine maps learner rank 0's buckets in place; NCCL refuses two
ranks on one GPU); disaggregated on GPUs -> broadcast (NCCL from learner rank 0 to every engine).
"""

from __future__ import annotations

from megatron_specrl.config import RESYNC_TRANSPORTS as TRANSPORTS, ConfigError
from megatron_specrl.config.placement import Placement


def resolve_transport(requested: str, placement: Placement, num_engines: int = 1, engine: str = "vllm") -> str:
    """The transport name to use; ConfigError when the requested one cannot work on this placement.
    cuda_ipc maps the buckets inside vLLM's workers (VLLMEngine.update_weights_in_workers): SGLang
    engines get the object store where vLLM would get IPC."""
    on_gpu = placement.gpus_per_engine > 0
    if requested == "auto":
        if not on_gpu:
            return "ray"
        if not placement.colocate:
            return "broadcast"
        # IPC handles point into one GPU's memory: only the engine on learner rank 0's GPU can map them.
        return "cuda_ipc" if num_engines == 1 and engine == "vllm" else "ray"
    if requested not in TRANSPORTS:
        raise ConfigError(f"trainer.resync_transport={requested!r}: expected auto, {', '.join(TRANSPORTS)}")
    if requested == "cuda_ipc":
        if engine != "vllm":
            raise ConfigError(f"trainer.resync_transport=cuda_ipc with rollout.engine={engine}: IPC buckets are "
                              "loaded inside vLLM's workers only; use ray or broadcast")
        if not (on_gpu and placement.colocate):
            raise ConfigError("trainer.resync_transport=cuda_ipc needs engines colocated on the learner's GPUs "
                              "(rollout.colocate=true on a GPU cluster); use ray or broadcast")
        if num_engines != 1:
            raise ConfigError(f"trainer.resync_transport=cuda_ipc with rollout.num_engines={num_engines}: the "
                              "buckets live on learner rank 0's GPU, which only one engine shares; use ray")
    if requested == "broadcast" and on_gpu and placement.colocate:
        raise ConfigError("trainer.resync_transport=broadcast with rollout.colocate=true on GPUs: NCCL cannot "
                          "put learner rank 0 and an engine on the same GPU; use cuda_ipc or ray")
    return requested
