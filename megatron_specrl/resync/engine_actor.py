"""The engine side of a sync, run inside each engine's Ray actor through `__ray_call__`.

An engine only exposes `update_weights(named_tensors, version)` (and, for CUDA IPC,
`update_weights_in_workers(load, kwargs, version)`: a loader run in its workers); how buckets reach
it is resync's business. These functions run in the
EngineActor process (`actor.engine` is the engine), so the engine modules import nothing from
resync and the whole sync protocol is read here and in learner_actor.py / routes.py.
"""

from __future__ import annotations

from megatron_specrl.resync.buckets import Bucket
from megatron_specrl.resync.group import BroadcastEndpoint
from megatron_specrl.resync.streams import receive_all


def endpoint(actor) -> BroadcastEndpoint:
    """This actor's membership of the broadcast group, kept on the actor between syncs."""
    if getattr(actor, "_resync_endpoint", None) is None:
        actor._resync_endpoint = BroadcastEndpoint()
    return actor._resync_endpoint


def join_group(actor, host: str, port: int, rank: int, world: int, generation: int, timeout_s: float) -> str:
    return endpoint(actor).join(host, port, rank, world, generation, timeout_s)


def load_payload(actor, blob: bytes | dict, version: int) -> int:
    """Object store: `blob` is a Bucket.to_payload() (or to_bytes()); Ray resolves an ObjectRef
    argument to it, so N actors read one object-store copy. Returns the tensor count."""
    named = Bucket.from_wire(blob).unflatten()
    actor.engine.update_weights(named, version)
    return len(named)


def receive_broadcast(actor, version: int) -> int:
    """Broadcast: load buckets until the sender's end sentinel; returns how many arrived."""
    return receive_all(endpoint(actor), lambda named: actor.engine.update_weights(named, version))


def load_ipc(actor, payload, version: int) -> int:
    """CUDA IPC: map learner rank 0's bucket in place and load it (the learner frees it after)."""
    return actor.engine.update_weights_in_workers(reload_ipc_in_worker, {"payload": payload}, version)


def reload_ipc_in_worker(worker, payload) -> int:
    """Runs inside each vLLM worker: open the learner's CUDA IPC handles on this worker's GPU and
    load in place (the learner keeps the bucket alive until every engine has returned)."""
    import torch

    from megatron_specrl.resync.transports import CudaIpcTransport
    named = CudaIpcTransport().unpack(payload, device=getattr(worker, "device", None))
    worker.reload_weights(weights_iterator=iter(named))
    from megatron_specrl.engines.vllm.worker_ops import repack_cpu_moe_experts
    repack_cpu_moe_experts(worker, [n for n, _ in named])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return len(named)


def submit(engine, fn, *args):
    """Start fn(actor, *args) in a RayEngine's actor; a ref to wait on with engine.wait."""
    return engine.submit_actor("__ray_call__", fn, *args)
