"""The loops that run inside the actors during a sync: send every bucket, receive until the end.

Learner rank 0 gets its buckets from the collective TP/PP gather, which every learner rank runs
in lockstep: when sending fails, rank 0 still drains the gather so the other ranks finish their
collectives (instead of hanging until the default group times out) and the learner stays usable.
A failing member also closes its broadcast group, so its peers fail at once rather than waiting
for the timeout.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from megatron_specrl.resync.buckets import Bucket
from megatron_specrl.resync.group import BroadcastEndpoint
from megatron_specrl.resync.transports import BroadcastTransport, CudaIpcTransport, IpcPayload


def drain(buckets: Iterator[Bucket]) -> None:
    for _ in buckets:
        pass


def broadcast_all(endpoint: BroadcastEndpoint, buckets: Iterator[Bucket]) -> dict[str, float]:
    """Source: every bucket, then the end sentinel. Returns what was sent."""
    transport = BroadcastTransport(endpoint.require(), src=0)
    n = nbytes = 0
    try:
        for bucket in buckets:
            transport.pack(bucket)
            n, nbytes = n + 1, nbytes + bucket.nbytes
        transport.send_end()
    except BaseException:
        endpoint.close()
        drain(buckets)
        raise
    return {"buckets": n, "bytes": nbytes}


def receive_all(endpoint: BroadcastEndpoint, load: Callable[[list[tuple[str, torch.Tensor]]], None]) -> int:
    """Receiver: `load` each bucket's HF-named tensors until the sentinel; returns the bucket count."""
    transport = BroadcastTransport(endpoint.require(), src=0)
    n = 0
    try:
        while (named := transport.unpack()) is not None:
            load(named)
            n += 1
    except BaseException:
        endpoint.close()
        raise
    return n


def push_ipc(buckets: Iterator[Bucket], device: torch.device,
             load_everywhere: Callable[[IpcPayload], None]) -> dict[str, float]:
    """Colocated source: each bucket is copied to this GPU, handed out as IPC handles and released
    only after `load_everywhere` returned (every engine has loaded it): one bucket alive at a time."""
    transport = CudaIpcTransport()
    n = nbytes = 0
    try:
        for bucket in buckets:
            on_device = Bucket({k: v.to(device) for k, v in bucket.buffers.items()}, bucket.metas)
            if device.type == "cuda":
                torch.cuda.synchronize(device)   # the copy must be complete before another process reads it
            transport.push(on_device, load_everywhere)
            n, nbytes = n + 1, nbytes + bucket.nbytes
            # Drop this bucket before the next is gathered and copied: a name still bound here kept
            # it (one bucket of GPU memory) alive beside the next one.
            del on_device, bucket
    except BaseException:
        drain(buckets)
        raise
    return {"buckets": n, "bytes": nbytes}
