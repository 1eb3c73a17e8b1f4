"""How a weight bucket travels from the learner to rollout engines.

A transport has two halves: `pack(bucket)` on the sender returns a payload that
is cheap to hand to the engine side (the bucket itself, an object-store ref, IPC
handles, or broadcast metadata) and `unpack(payload)` on the receiver turns it
back into HF-named tensors for `engine.update_weights`.

- InProcessTransport: same process (tests, colocated single-process runs).
- RayObjectStoreTransport: safetensors bytes through Ray's object store (CPU, any host).
- CudaIpcTransport: colocated learner and engine on one GPU; ships
  `torch.multiprocessing.reductions.reduce_tensor` handles (vLLM collective_rpc,
  SGLang update_weights_from_tensor do the same), no copy through host memory.
- NcclBroadcastTransport: disaggregated engines; one process group per pipeline
  stage (stage's learner rank 0 + every engine worker), buckets are broadcast.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from megatron_specrl.resync.buckets import Bucket, TensorMeta


class Transport(ABC):
    name = "abstract"

    @abstractmethod
    def pack(self, bucket: Bucket) -> Any:
        """Sender side: payload for one bucket."""

    @abstractmethod
    def unpack(self, payload: Any) -> list[tuple[str, torch.Tensor]]:
        """Receiver side: HF-named tensors of the bucket."""


class InProcessTransport(Transport):
    name = "inprocess"

    def pack(self, bucket: Bucket) -> Bucket:
        return bucket

    def unpack(self, payload: Bucket) -> list[tuple[str, torch.Tensor]]:
        return payload.unflatten()


class RayObjectStoreTransport(Transport):
    """One `ray.put` per bucket; every engine actor reads the same object (no N copies)."""

    name = "ray"

    def pack(self, bucket: Bucket):
        import ray
        return ray.put(bucket.to_payload())

    def unpack(self, payload) -> list[tuple[str, torch.Tensor]]:
        import ray
        blob = ray.get(payload) if isinstance(payload, ray.ObjectRef) else payload
        return Bucket.from_wire(blob).unflatten()


@dataclass
class IpcPayload:
    metas_json: str
    handles: dict[str, tuple]      # dtype -> (rebuild_fn, args) from reduce_tensor


class CudaIpcTransport(Transport):
    """Handles to the sender's buffers; the sender must keep the bucket alive until
    every receiver has loaded it (`keep` holds it until `release()`)."""

    name = "cuda_ipc"

    def __init__(self):
        self._keep: list[Bucket] = []

    def pack(self, bucket: Bucket) -> IpcPayload:
        from torch.multiprocessing.reductions import reduce_tensor
        self._keep.append(bucket)
        return IpcPayload(bucket.meta_json(), {k: reduce_tensor(v) for k, v in bucket.buffers.items()})

    def unpack(self, payload: IpcPayload) -> list[tuple[str, torch.Tensor]]:
        buffers = {k: fn(*args) for k, (fn, args) in payload.handles.items()}
        return Bucket(buffers, Bucket.metas_from_json(payload.metas_json)).unflatten()

    def release(self) -> None:
        self._keep.clear()


class NcclBroadcastTransport(Transport):
    """Broadcast over a torch.distributed group (NCCL on GPU; gloo works the same on CPU).

    Protocol per bucket: the source broadcasts the metadata (names, shapes, buffer sizes)
    as an object, then each dtype buffer in sorted dtype order; receivers allocate
    and receive in the same order. `pack` runs on the source, `unpack(None)` on receivers.
    """

    name = "nccl"

    def __init__(self, group=None, src: int = 0, device: str | torch.device = "cuda"):
        self.group, self.src, self.device = group, src, torch.device(device)

    @staticmethod
    def header(bucket: Bucket) -> dict:
        return {"metas": bucket.meta_json(),
                "buffers": [(k, bucket.buffers[k].numel()) for k in sorted(bucket.buffers)]}

    def pack(self, bucket: Bucket) -> dict:
        import torch.distributed as dist
        head = self.header(bucket)
        dist.broadcast_object_list([head], src=self.src, group=self.group)
        for k, _ in head["buffers"]:
            dist.broadcast(bucket.buffers[k].to(self.device), src=self.src, group=self.group)
        return head

    def unpack(self, payload=None) -> list[tuple[str, torch.Tensor]]:
        import torch.distributed as dist
        box = [None]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        head = box[0]
        buffers = {}
        for k, n in head["buffers"]:
            buf = torch.empty(n, dtype=getattr(torch, k), device=self.device)
            dist.broadcast(buf, src=self.src, group=self.group)
            buffers[k] = buf
        return Bucket(buffers, Bucket.metas_from_json(head["metas"])).unflatten()


def stage_groups(pp_size: int, num_engine_workers: int, learner_ranks_of_stage) -> list[list[int]]:
    """Ranks of the per-pipeline-stage broadcast groups when disaggregated: the stage's
    first learner rank (the source) plus every engine worker, which are appended after
    the learner world. `learner_ranks_of_stage(stage) -> list[int]`."""
    learner_world = max(max(learner_ranks_of_stage(s)) for s in range(pp_size)) + 1
    engines = list(range(learner_world, learner_world + num_engine_workers))
    return [[min(learner_ranks_of_stage(s))] + engines for s in range(pp_size)]


__all__ = ["Transport", "InProcessTransport", "RayObjectStoreTransport", "CudaIpcTransport",
           "NcclBroadcastTransport", "IpcPayload", "TensorMeta", "stage_groups"]
