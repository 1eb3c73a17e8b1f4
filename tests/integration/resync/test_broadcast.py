"""The broadcast transport over its own gloo group (TCPStore + ProcessGroupGloo, no init_process_group),
between real processes: a clean transfer, and receivers that fail with a clear error - not a hang -
when the sender dies, sends a malformed header or stays silent; a sender whose receiver died still
drains the learner's gather.
"""

from __future__ import annotations
import pickle
import time
import pytest
import torch
from tests.helpers.fake_weights import model_tensors, recorded_tensors
from megatron_specrl.resync.buckets import plan_buckets
from megatron_specrl.resync.group import BroadcastEndpoint, ResyncTransportError
from megatron_specrl.resync.streams import broadcast_all, receive_all
from megatron_specrl.resync.transports import BroadcastTransport

TIMEOUT_S = 4.0


def _sender(mode: str, world: int, queue) -> None:
    """Group rank 0 in its own process, like learner rank 0: opens the store, joins, then `mode`."""
    import os
    ep = BroadcastEndpoint()
    addr = ep.open_store("127.0.0.1", TIMEOUT_S)
    queue.put(addr)
    ep.join(*addr, 0, world, 1, TIMEOUT_S)
    t = BroadcastTransport(ep.group)
    buckets = plan_buckets(iter(model_tensors()), 3000)
    if mode == "ok":
        queue.put(broadcast_all(ep, buckets))
    elif mode == "die":                    # one bucket, then the process is killed mid-sync
        t.pack(next(buckets))
        t._send_header(t.header(next(buckets)))
        os._exit(17)
    elif mode == "garbage":
        data = b"\x80not json at all"
        ep.group.broadcast(torch.tensor([len(data)]), 0, "header size")
        ep.group.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, "header")
    elif mode == "silent":
        pass
    queue.put("done")
    time.sleep(2 * TIMEOUT_S if mode == "silent" else 1.0)   # keep the sockets open while receivers wait
    ep.close()


def _receiver(host_port, rank: int, world: int, queue) -> None:
    ep = BroadcastEndpoint()
    ep.join(*host_port, rank, world, 1, TIMEOUT_S)
    got = []
    n = receive_all(ep, lambda named: got.extend((k, v.clone()) for k, v in named))
    # By value: a tensor put on the queue as is is shared by file descriptor, which the parent can
    # only fetch while this process lives - and it exits right after the put.
    queue.put((rank, n, pickle.dumps(got)))


def _start_sender(mode: str, world: int):
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_sender, args=(mode, world, q), daemon=True)
    p.start()
    return ctx, p, q, q.get(timeout=60)


def _join_here(host_port, rank: int, world: int) -> BroadcastEndpoint:
    ep = BroadcastEndpoint()
    assert ep.join(*host_port, rank, world, 1, TIMEOUT_S) == "gloo"
    return ep


@pytest.mark.slow
def test_two_receivers_get_every_tensor_exactly():
    ctx, sender, q, addr = _start_sender("ok", world=3)
    other = ctx.Process(target=_receiver, args=(addr, 2, 3, q), daemon=True)
    other.start()
    ep = _join_here(addr, 1, 3)
    got = []
    n = receive_all(ep, lambda named: got.extend(named))
    msgs = [q.get(timeout=30) for _ in range(3)]    # sender: what it sent, "done"; other receiver: a tuple
    (sent,) = [m for m in msgs if isinstance(m, dict)]
    ((_, n_other, got_other),) = [m for m in msgs if isinstance(m, tuple)]
    got_other = pickle.loads(got_other)
    sender.join(30)
    other.join(30)
    ref = model_tensors()
    assert sent["buckets"] == n == n_other == len(list(plan_buckets(iter(ref), 3000))) and n > 3
    assert sent["bytes"] == sum(t.numel() * t.element_size() for _, t in ref)
    for received in (got, got_other):
        assert [k for k, _ in received] == [k for k, _ in ref]
        assert all(a.dtype == b.dtype and torch.equal(a, b) for (_, a), (_, b) in zip(ref, received))
    assert sender.exitcode == 0 and other.exitcode == 0


@pytest.mark.slow
def test_receiver_fails_fast_when_sender_dies():
    _, sender, _, addr = _start_sender("die", world=2)
    ep = _join_here(addr, 1, 2)
    loaded = []
    t0 = time.monotonic()
    with pytest.raises(ResyncTransportError, match=r"receiving buffer \w+ from group rank 0 failed"):
        receive_all(ep, loaded.append)
    assert time.monotonic() - t0 < TIMEOUT_S + 2
    assert len(loaded) == 1 and ep.group is None        # the bucket before the death; the group is closed
    sender.join(30)
    assert sender.exitcode == 17


@pytest.mark.slow
def test_receiver_rejects_malformed_header():
    _, sender, q, addr = _start_sender("garbage", world=2)
    ep = _join_here(addr, 1, 2)
    with pytest.raises(ResyncTransportError, match="malformed header: not JSON"):
        receive_all(ep, lambda named: None)
    assert q.get(timeout=30) == "done"
    sender.join(30)


@pytest.mark.slow
def test_receiver_times_out_when_sender_is_silent():
    _, sender, q, addr = _start_sender("silent", world=2)
    ep = _join_here(addr, 1, 2)
    t0 = time.monotonic()
    with pytest.raises(ResyncTransportError, match=r"receiving header size from group rank 0 failed \(timeout 4s\)"):
        receive_all(ep, lambda named: None)
    assert TIMEOUT_S - 0.5 < time.monotonic() - t0 < TIMEOUT_S + 3
    sender.kill()


def _quitter(host_port, queue) -> None:
    """A receiver that joins and exits before the first bucket arrives."""
    ep = BroadcastEndpoint()
    ep.join(*host_port, 1, 2, 1, TIMEOUT_S)
    queue.put("joined")


@pytest.mark.slow
def test_sender_drains_the_gather_when_its_receiver_died():
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    ep = BroadcastEndpoint()
    addr = ep.open_store("127.0.0.1", TIMEOUT_S)
    q = ctx.Queue()
    quitter = ctx.Process(target=_quitter, args=(addr, q), daemon=True)
    quitter.start()
    ep.join(*addr, 0, 2, 1, TIMEOUT_S)
    assert q.get(timeout=30) == "joined"
    quitter.join(30)
    pulled = []
    with pytest.raises(ResyncTransportError, match="sending"):      # the source stands in for the gather
        broadcast_all(ep, plan_buckets(recorded_tensors(pulled), 3000))
    assert pulled == [n for n, _ in model_tensors()]     # every rank's collective ran to the end
    assert ep.group is None


@pytest.mark.parametrize("data, needle", [
    (b'{"metas": "[]"}', "expected keys metas and buffers"),
    (b'{"metas": "[[\\"w\\", \\"float32\\", [4, 4], 0, 16]]", "buffers": [["float32", 8]]}',
     "tensor w (float32, shape (4, 4), offset 0) does not fit"),
    (b'{"metas": "[]", "buffers": [["floaty", 8]]}', "buffer 'floaty'"),
    (b'{"metas": "not json", "buffers": []}', "malformed header"),
    (b"[1, 2]", "expected keys metas and buffers, got list"),
])
def test_header_checks_name_the_problem(data, needle):
    with pytest.raises(ResyncTransportError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        BroadcastTransport.parse_header(data)


def test_header_round_trip_and_end_sentinel():
    import json
    (bucket,) = plan_buckets(iter(model_tensors()), 1 << 30)
    head = BroadcastTransport.parse_header(json.dumps(BroadcastTransport.header(bucket)).encode())
    assert head["metas"] == bucket.metas
    assert head["buffers"] == sorted((k, v.numel()) for k, v in bucket.buffers.items())
    assert BroadcastTransport.parse_header(json.dumps(BroadcastTransport.END).encode()) is None
