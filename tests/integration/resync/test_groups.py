"""Resync: the NCCL group's op timeout (torch ProcessGroupNCCL options, checked
on CPU with a fake class; GPU tests beside them), CUDA IPC device buckets freed before the next one,
and pins of bucket packing's edges.
"""

import gc
import weakref
from datetime import timedelta
import pytest
import torch
import torch.distributed as dist
from megatron_specrl.resync import group as resync_group
from megatron_specrl.resync import streams
from megatron_specrl.resync.buckets import plan_buckets
from megatron_specrl.resync.group import ResyncTransportError

class FakeOptions:
    """ProcessGroupNCCL.Options' defaults: 10 min watchdog timeout, high-priority stream off."""

    def __init__(self):
        self._timeout = timedelta(minutes=10)
        self.is_high_priority_stream = True


class FakeWork:
    def __init__(self, pg, outcome):
        self.pg, self.outcome = pg, outcome

    def wait(self, timeout=None):
        self.pg.waits.append(timeout)
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


class FakeNcclPG:
    """ProcessGroupNCCL's constructor and broadcast as distributed_c10d calls them."""

    Options = FakeOptions
    outcomes: list = []

    def __init__(self, store, rank, world, options):
        self.store, self.rank, self.world, self.options = store, rank, world, options
        self.waits, self.sent, self.aborted = [], [], 0

    def broadcast(self, tensors, opts):
        self.sent.append((tensors[0].clone(), opts.rootRank))
        return FakeWork(self, self.outcomes.pop(0) if self.outcomes else True)

    def abort(self):
        self.aborted += 1


def _group(timeout_s=7.0, rank=1, outcomes=()):
    FakeNcclPG.outcomes = list(outcomes)
    return resync_group.NcclGroup(object(), rank, 3, timeout_s, pg_cls=FakeNcclPG, device=torch.device("cpu"))


# -- the NCCL op timeout (new: each test fails before the fix, which had no torch NCCL group) -------

def test_nccl_options_carry_the_group_timeout():
    opts = resync_group.nccl_options(FakeOptions, 7.0)
    assert isinstance(opts, FakeOptions) and opts.is_high_priority_stream is False
    # the watchdog's timeout: ours plus a grace, so the op's own blocking wait raises first
    assert opts._timeout == timedelta(seconds=7.0 + resync_group.NCCL_WATCHDOG_GRACE_S)
    assert resync_group.NCCL_WATCHDOG_GRACE_S < 30.0   # and it fires before the driver's (routes.GRACE_S)


def test_nccl_group_builds_its_pg_with_the_options_and_waits_each_op_with_the_timeout():
    g = _group()
    assert g.backend == "nccl" and g.pg.rank == 1 and g.pg.world == 3
    assert g.pg.options._timeout == timedelta(seconds=7.0 + resync_group.NCCL_WATCHDOG_GRACE_S)
    assert len(g.pg.sent) == 1 and g.pg.sent[0][1] == 0   # the join handshake built the communicator
    t = torch.arange(4)
    g.broadcast(t, 0, "header size")
    assert g.pg.sent[-1][1] == 0 and torch.equal(g.pg.sent[-1][0], t)
    assert g.pg.waits == [timedelta(seconds=7.0)] * 2


@pytest.mark.parametrize("outcome, says", [
    (RuntimeError("[PG 1 Rank 1] Work WorkNCCL(SeqNum=3, OpType=BROADCAST) timed out in blocking wait.\n"
                  "Exception raised from ... (most recent call first):"), "timed out in blocking wait."),
    (False, "not complete after 7s"),
])
def test_a_timed_out_nccl_op_is_one_line_naming_the_transfer_and_the_peer(outcome, says):
    g = _group(outcomes=[True, outcome])
    with pytest.raises(ResyncTransportError) as err:
        g.broadcast(torch.zeros(1), 0, "buffer bfloat16")
    msg = str(err.value)
    assert "\n" not in msg and msg.endswith(says)
    assert msg.startswith("resync broadcast (nccl, rank 1/3): receiving buffer bfloat16 from group rank 0 "
                          "failed (timeout 7s)")


def test_nccl_group_close_aborts_once_and_a_closed_group_refuses_ops():
    g = _group()
    pg = g.pg
    g.close()
    g.close()
    assert pg.aborted == 1 and g.pg is None
    with pytest.raises(ResyncTransportError, match="closed"):
        g.broadcast(torch.zeros(1), 0, "header")


def test_a_failed_nccl_join_handshake_aborts_the_group():
    made = []

    class Recording(FakeNcclPG):
        def __init__(self, *a):
            super().__init__(*a)
            made.append(self)

    FakeNcclPG.outcomes = [RuntimeError("ncclCommInitRank: store timeout")]
    with pytest.raises(ResyncTransportError, match="join handshake from group rank 0 failed .*store timeout"):
        resync_group.NcclGroup(object(), 2, 3, 5.0, pg_cls=Recording, device=torch.device("cpu"))
    assert made[0].aborted == 1


def test_endpoint_joins_torch_nccl_when_cuda_is_there(monkeypatch):
    """On CUDA the endpoint builds torch's NCCL group (the one with a timeout); without NCCL in torch,
    vLLM's communicator; without CUDA, gloo."""
    built = []

    class Fake:
        backend = "nccl"

        def __init__(self, store, rank, world, timeout_s):
            built.append((rank, world, timeout_s))

        def close(self):
            pass

    monkeypatch.setattr(resync_group, "NcclGroup", Fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    ep = resync_group.BroadcastEndpoint()
    host, port = ep.open_store("127.0.0.1", 10.0)
    assert ep.join(host, port, 0, 1, 1, 10.0) == "nccl" and isinstance(ep.group, Fake)
    assert built == [(0, 1, 10.0)]
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    assert resync_group.group_class() is resync_group.PyncclGroup
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resync_group.group_class() is resync_group.GlooGroup
    ep.close()


# -- CUDA IPC: a device bucket is freed before the next one is built (bug: it lingered) -------------

def test_push_ipc_frees_each_device_bucket_before_gathering_the_next(monkeypatch):
    """push_ipc's `on_device` name kept the pushed bucket (one bucket of GPU memory) alive while the
    learner gathered and copied the next one: two buckets at a time, not the documented one."""
    pushed = []

    class Transport:
        def push(self, bucket, load_everywhere):
            pushed.append(weakref.ref(bucket))
            load_everywhere(None)

    alive_when_next = []

    def source():
        for b in plan_buckets(iter([(f"model.layers.{i}.w", torch.full((64,), float(i))) for i in range(4)]), 256):
            gc.collect()
            alive_when_next.append([r() is not None for r in pushed])
            yield b

    monkeypatch.setattr(streams, "CudaIpcTransport", Transport)
    out = streams.push_ipc(source(), torch.device("cpu"), lambda payload: None)
    assert out["buckets"] == 4 and len(pushed) == 4
    assert alive_when_next == [[], [False], [False, False], [False, False, False]]


# -- pins (no bug found): bucket packing's edges ------------------------------------------------------

def test_plan_buckets_edges_are_pinned():
    """An oversized tensor gets a bucket of its own between full ones, dtypes keep their own buffers and
    offsets, the last partial bucket comes out, nothing is lost or reordered, an empty model is no bucket."""
    ts = [("model.layers.0.a", torch.ones(10)),                       # 40 B
          ("model.layers.1.b", torch.arange(4, dtype=torch.int64)),    # 32 B
          ("lm_head.weight", torch.randn(100)),                        # 400 B: over the budget
          ("model.layers.2.c", torch.ones(3, dtype=torch.bfloat16)),   # 6 B
          ("model.layers.2.d", torch.ones(2, 2))]                      # 16 B, same layer as c
    buckets = list(plan_buckets(iter(ts), 100))
    assert [b.names for b in buckets] == [["model.layers.0.a", "model.layers.1.b"], ["lm_head.weight"],
                                          ["model.layers.2.c", "model.layers.2.d"]]
    assert sorted(buckets[0].buffers) == ["float32", "int64"] and [m.offset for m in buckets[0].metas] == [0, 0]
    flat = [x for b in buckets for x in b.unflatten()]
    assert [n for n, _ in flat] == [n for n, _ in ts]
    assert all(a.dtype == b.dtype and torch.equal(a, b) for (_, a), (_, b) in zip(ts, flat))
    assert list(plan_buckets(iter([]), 100)) == []


# -- GPU: the real ProcessGroupNCCL -------------------------------------------------------------------









def test_cuda_ipc_push_keeps_no_bucket_that_pack_refused():
    """A bucket pack refuses (buffers on two devices) was kept: pack stored it before checking and
    push's release only ran once pack had returned."""
    from megatron_specrl.resync.buckets import Bucket
    from megatron_specrl.resync.transports import CudaIpcTransport
    t = CudaIpcTransport()
    mixed = Bucket({"float32": torch.zeros(2), "int64": torch.zeros(2, dtype=torch.int64, device="meta")}, [])
    with pytest.raises(ValueError, match="one device"):
        t.push(mixed, lambda payload: None)
    assert t.kept == 0


def test_the_broadcast_store_listens_on_the_cluster_address_only():
    """torch's TCPStore binds every interface; the resync store binds the address it was opened on (the
    learner node's cluster address), so other interfaces of the node refuse connections."""
    import socket

    ep = resync_group.BroadcastEndpoint()
    host, port = ep.open_store("127.0.0.1", 10.0)
    with socket.create_connection((host, port), timeout=2):
        pass
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.2", port), timeout=2).close()   # another address of this host
    member = resync_group.BroadcastEndpoint()
    member._store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10))
    member._store.set("k", "v")
    assert ep._store.get("k") == b"v"
