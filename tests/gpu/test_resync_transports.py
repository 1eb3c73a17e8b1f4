"""CUDA-only: the CUDA IPC transport and the NCCL resync group. Their CPU counterparts (the same plumbing on
gloo and CPU tensors) are tests/integration/resync/test_buckets.py and test_groups.py.
"""

import os
import subprocess
import sys
import textwrap
from datetime import timedelta

import torch.distributed as dist

from megatron_specrl.resync import group as resync_group
from megatron_specrl.resync.group import ResyncTransportError


import pytest
import torch
from tests.helpers.fake_weights import model_tensors
from megatron_specrl.resync.buckets import plan_buckets
from megatron_specrl.resync.transports import (
    CudaIpcTransport,
)


def _open_ipc_in_child(payload, results):
    """The receiving process: map the sender's GPU buffers and send back host copies."""
    torch.cuda.set_device(0)
    got = CudaIpcTransport().unpack(payload, device=0)
    # bytes, not tensors: a CPU tensor through the queue is a shared-memory handle that dies with this process
    results.put([(n, t.device.type, str(t.dtype), t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
                 for n, t in got])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ipc_transport_gpu():
    """A second process maps the bucket in place. (CUDA refuses to open a process's own IPC handles:
    this test did so in one process and failed on the first GPU it met, an H200 on 2026-11-28.)"""
    import torch.multiprocessing as mp
    (bucket,) = plan_buckets(iter([(n, t.cuda()) for n, t in model_tensors()]), 1 << 30)
    t = CudaIpcTransport()
    payload = t.pack(bucket)
    assert payload.device_uuid == str(torch.cuda.get_device_properties(0).uuid)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=_open_ipc_in_child, args=(payload, results))
    child.start()
    try:
        got = results.get(timeout=120)
    finally:
        child.join(30)
        t.release()
    assert [n for n, _, _, _ in got] == [n for n, _ in model_tensors()]
    assert all(dev == "cuda" and dtype == str(a.dtype) and a.contiguous().view(torch.uint8).numpy().tobytes() == raw
               for (_, a), (_, dev, dtype, raw) in zip(model_tensors(), got))


def _cuda_nccl():
    return torch.cuda.is_available() and dist.is_nccl_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_nccl(), reason="needs CUDA and torch's NCCL")
def test_nccl_group_gpu_has_our_timeout():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    g = resync_group.NcclGroup(dist.PrefixStore("specrl-resync/1", store), 0, 1, 30.0)
    try:
        assert g.pg.options._timeout == timedelta(seconds=30.0 + resync_group.NCCL_WATCHDOG_GRACE_S)
        t = torch.arange(8, device=g.device)
        g.broadcast(t, 0, "buffer int64")
        assert t.tolist() == list(range(8))
    finally:
        g.close()


_SILENT_PEER = textwrap.dedent("""
    import sys, time, torch, torch.distributed as dist
    from datetime import timedelta
    from megatron_specrl.resync.group import NcclGroup
    torch.cuda.set_device(1)
    store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=30))
    g = NcclGroup(dist.PrefixStore("specrl-resync/1", store), 1, 2, 5.0)
    time.sleep(60)      # in the group, never in the next op
""")


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_nccl() or torch.cuda.device_count() < 2, reason="needs 2 GPUs and torch's NCCL")
def test_nccl_silent_peer_is_an_error_within_the_timeout_gpu():
    import time
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    peer = subprocess.Popen([sys.executable, "-c", _SILENT_PEER, str(store.port)], env=env)
    try:
        torch.cuda.set_device(0)
        g = resync_group.NcclGroup(dist.PrefixStore("specrl-resync/1", store), 0, 2, 5.0)
        t0 = time.monotonic()
        # rank 0 receives from the silent peer (a small send could finish into NCCL's buffers alone)
        with pytest.raises(ResyncTransportError, match=r"nccl, rank 0/2\): receiving header size from group "
                                                       r"rank 1 failed \(timeout 5s\)"):
            g.broadcast(torch.ones(1, dtype=torch.int64, device=g.device), 1, "header size")
        assert time.monotonic() - t0 < 5.0 + resync_group.NCCL_WATCHDOG_GRACE_S
        g.close()
    finally:
        peer.kill()
        peer.wait()


