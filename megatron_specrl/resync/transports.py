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
- BroadcastTransport: one dedicated group (resync.group) of learner rank 0, which has
  gathered every stage's tensors, + one receiver per engine; gloo on CPU, NCCL on GPU.

Which one a run uses: resync.choose; how a sync drives it: resync.routes.
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

import torch

from megatron_specrl.resync.buckets import Bucket, TensorMeta
from megatron_specrl.resync.group import ResyncTransportError


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
    device_uuid: str | None = None  # the sender's GPU (None: CPU shared memory, tests)


def _device_uuid(device: torch.device) -> str | None:
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else None


class CudaIpcTransport(Transport):
    """Handles to the sender's buffers; the sender keeps the bucket alive until every receiver
    has loaded it (`push`), because the receivers read the sender's memory in place."""

    name = "cuda_ipc"

    def __init__(self):
        self._keep: list[Bucket] = []

    @property
    def kept(self) -> int:
        return len(self._keep)

    def pack(self, bucket: Bucket) -> IpcPayload:
        from torch.multiprocessing.reductions import reduce_tensor
        self._keep.append(bucket)
        devices = {v.device for v in bucket.buffers.values()}
        if len(devices) > 1:
            raise ValueError(f"cuda_ipc: a bucket's buffers must share one device, got {sorted(map(str, devices))}")
        uuid = _device_uuid(devices.pop()) if devices else None
        return IpcPayload(bucket.meta_json(), {k: reduce_tensor(v) for k, v in bucket.buffers.items()}, uuid)

    def unpack(self, payload: IpcPayload, device: int | torch.device | None = None) -> list[tuple[str, torch.Tensor]]:
        """On a GPU the handles are re-pointed at this process's index of the sender's GPU (processes
        may see it under different CUDA_VISIBLE_DEVICES); another GPU cannot map them at all."""
        handles = payload.handles
        if payload.device_uuid is not None:
            index = None if device is None else torch.device(device).index
            device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
            local = _device_uuid(device)
            if local != payload.device_uuid:
                raise ResyncTransportError(f"cuda_ipc: the bucket is on GPU {payload.device_uuid}, this process "
                                           f"is on GPU {local}; IPC handles only open on the same GPU")
            handles = {k: (fn, _with_device(args, device.index)) for k, (fn, args) in handles.items()}
        buffers = {k: fn(*args) for k, (fn, args) in handles.items()}
        return Bucket(buffers, Bucket.metas_from_json(payload.metas_json)).unflatten()

    def push(self, bucket: Bucket, load_everywhere: Callable[[IpcPayload], Any]) -> Any:
        """Pack, wait until `load_everywhere` returns (every engine has loaded), then release."""
        try:   # pack inside: a bucket it refuses (buffers on two devices) is not kept either
            return load_everywhere(self.pack(bucket))
        finally:
            self.release()

    def release(self) -> None:
        self._keep.clear()


def _with_device(args: tuple, index: int) -> tuple:
    """rebuild_cuda_tensor's 7th argument is the device index (torch.multiprocessing.reductions)."""
    return (*args[:6], index, *args[7:])


class BroadcastTransport(Transport):
    """Broadcast over an explicit group (resync.group: gloo on CPU, NCCL on GPU).

    Protocol per bucket: a JSON header (tensor metas + per-dtype buffer sizes, or the end-of-sync
    sentinel) as a length then its bytes, then each dtype buffer as raw bytes in the header's order.
    `pack` runs on the source; `unpack()` on receivers returns None at the sentinel.
    """

    name = "broadcast"
    END = {"end": True}
    MAX_HEADER_BYTES = 64 << 20

    def __init__(self, group, src: int = 0, device: str | torch.device | None = None):
        self.group, self.src = group, src
        self.device = torch.device(device) if device is not None else getattr(group, "device", torch.device("cpu"))

    @staticmethod
    def header(bucket: Bucket) -> dict:
        return {"metas": bucket.meta_json(),
                "buffers": [(k, bucket.buffers[k].numel()) for k in sorted(bucket.buffers)]}

    # -- sender ---------------------------------------------------------------
    def pack(self, bucket: Bucket) -> dict:
        head = self.header(bucket)
        self._send_header(head)
        for k, _ in head["buffers"]:
            buf = bucket.buffers[k].to(self.device).contiguous()
            self.group.broadcast(buf.view(torch.uint8), self.src, f"buffer {k}")
        return head

    def send_end(self) -> None:
        self._send_header(self.END)

    def _send_header(self, head: dict) -> None:
        data = json.dumps(head).encode()
        self.group.broadcast(torch.tensor([len(data)], dtype=torch.int64, device=self.device), self.src, "header size")
        self.group.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device), self.src, "header")

    # -- receiver -------------------------------------------------------------
    def unpack(self, payload=None) -> list[tuple[str, torch.Tensor]] | None:
        head = self._recv_header()
        if head is None:
            return None
        buffers = {}
        for k, n in head["buffers"]:
            buf = torch.empty(n, dtype=getattr(torch, k), device=self.device)
            self.group.broadcast(buf.view(torch.uint8), self.src, f"buffer {k}")
            buffers[k] = buf
        return Bucket(buffers, head["metas"]).unflatten()

    def _recv_header(self) -> dict | None:
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.group.broadcast(size, self.src, "header size")
        n = int(size.item())
        if not 0 < n <= self.MAX_HEADER_BYTES:
            raise ResyncTransportError(f"resync broadcast: malformed header: size {n} bytes "
                                       f"(expected 1..{self.MAX_HEADER_BYTES})")
        data = torch.empty(n, dtype=torch.uint8, device=self.device)
        self.group.broadcast(data, self.src, "header")
        return self.parse_header(data.cpu().numpy().tobytes())

    @classmethod
    def parse_header(cls, data: bytes) -> dict | None:
        """Decoded, checked header (metas as TensorMeta); None for the end sentinel."""
        try:
            head = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ResyncTransportError(f"resync broadcast: malformed header: not JSON ({e})") from None
        if head == cls.END:
            return None
        if not isinstance(head, dict) or set(head) != {"metas", "buffers"}:
            raise ResyncTransportError(f"resync broadcast: malformed header: expected keys metas and buffers, "
                                       f"got {sorted(head) if isinstance(head, dict) else type(head).__name__}")
        try:
            sizes = {str(k): int(n) for k, n in head["buffers"]}
            metas = Bucket.metas_from_json(head["metas"])
        except (TypeError, ValueError) as e:
            raise ResyncTransportError(f"resync broadcast: malformed header: {e}") from None
        for k, n in sizes.items():
            if not isinstance(getattr(torch, k, None), torch.dtype) or n < 0:
                raise ResyncTransportError(f"resync broadcast: malformed header: buffer {k!r} of {n} elements")
        for m in metas:
            if m.dtype not in sizes or m.offset < 0 or m.offset + m.numel > sizes[m.dtype] \
                    or m.numel != math.prod(m.shape):
                raise ResyncTransportError(f"resync broadcast: malformed header: tensor {m.name} "
                                           f"({m.dtype}, shape {m.shape}, offset {m.offset}) does not fit its buffer")
        return {"metas": metas, "buffers": sorted(sizes.items())}


def stage_groups(pp_size: int, num_engine_workers: int, learner_ranks_of_stage) -> list[list[int]]:
    """Not used yet (syncs gather to learner rank 0 and use one group): ranks of per-pipeline-stage
    broadcast groups, for a variant where each stage broadcasts its own layers. The stage's
    first learner rank (the source) plus every engine worker, which are appended after
    the learner world. `learner_ranks_of_stage(stage) -> list[int]`."""
    learner_world = max(max(learner_ranks_of_stage(s)) for s in range(pp_size)) + 1
    engines = list(range(learner_world, learner_world + num_engine_workers))
    return [[min(learner_ranks_of_stage(s))] + engines for s in range(pp_size)]


__all__ = ["Transport", "InProcessTransport", "RayObjectStoreTransport", "CudaIpcTransport",
           "BroadcastTransport", "IpcPayload", "ResyncTransportError", "TensorMeta", "stage_groups"]
