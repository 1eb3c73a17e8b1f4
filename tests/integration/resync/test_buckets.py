"""Weight-resync buckets and transports (CPU; GPU transports' plumbing tested on CPU).
"""

import pytest
import torch
from tests.helpers.fake_weights import model_tensors, recorded_tensors
from megatron_specrl.resync.buckets import Bucket, layer_group, plan_buckets
from megatron_specrl.resync.transports import (
    BroadcastTransport, CudaIpcTransport, InProcessTransport, RayObjectStoreTransport, stage_groups,
)

def nbytes(t):
    return t.numel() * t.element_size()


def test_layer_group():
    assert layer_group("model.layers.12.mlp.up_proj.weight") == "model.layers.12"
    assert layer_group("lm_head.weight") == "lm_head.weight"


@pytest.mark.parametrize("bucket_bytes", [1, 3000, 5000, 1 << 30])
def test_plan_roundtrip_order_and_layers_whole(bucket_bytes):
    ts = model_tensors()
    buckets = list(plan_buckets(iter(ts), bucket_bytes))
    flat = [(n, t) for b in buckets for n, t in b.unflatten()]
    assert [n for n, _ in flat] == [n for n, _ in ts]
    for (_, a), (_, b) in zip(ts, flat):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    seen = {}
    for k, b in enumerate(buckets):
        for n in b.names:                              # a layer never spans two buckets
            assert seen.setdefault(layer_group(n), k) == k
        if len({layer_group(n) for n in b.names}) > 1:
            assert b.nbytes <= bucket_bytes            # only a single oversized group may exceed
        assert set(b.buffers) <= {"float32", "bfloat16"} and all(v.dim() == 1 for v in b.buffers.values())
    if bucket_bytes == 1 << 30:
        assert len(buckets) == 1
    if bucket_bytes == 1:
        assert len(buckets) == len({layer_group(n) for n, _ in ts})


def test_oversized_tensor_gets_own_bucket():
    ts = [("a", torch.zeros(10)), ("big", torch.zeros(1000)), ("b", torch.zeros(10))]
    bs = list(plan_buckets(iter(ts), 100))
    assert [b.names for b in bs] == [["a"], ["big"], ["b"]]


def test_plan_is_streaming():
    """The planner pulls tensors lazily: the first bucket is out before the source is exhausted."""
    pulled = []
    it = plan_buckets(recorded_tensors(pulled), 3000)
    first = next(it)
    assert len(pulled) < len(model_tensors()) and first.names


def test_bytes_roundtrip_and_transports():
    ts = model_tensors()
    (bucket,) = plan_buckets(iter(ts), 1 << 30)
    again = Bucket.from_bytes(bucket.to_bytes())
    assert again.metas == bucket.metas
    for transport in (InProcessTransport(), CudaIpcTransport()):   # IPC handles work for CPU tensors too
        got = transport.unpack(transport.pack(bucket))
        assert [n for n, _ in got] == [n for n, _ in ts] and all(torch.equal(a, b) for (_, a), (_, b) in zip(ts, got))
    ray_t = RayObjectStoreTransport()
    got = ray_t.unpack(bucket.to_bytes())                           # what an actor receives for a ref
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(ts, got))


def test_broadcast_header_and_stage_groups():
    (bucket,) = plan_buckets(iter(model_tensors()), 1 << 30)
    head = BroadcastTransport.header(bucket)
    assert [k for k, _ in head["buffers"]] == ["bfloat16", "float32"]          # fixed order on all ranks
    assert dict(head["buffers"]) == {k: v.numel() for k, v in bucket.buffers.items()}
    # learner TP2 x PP2 (ranks 0-3, stage s = ranks 2s, 2s+1) + 2 engine workers
    assert stage_groups(2, 2, lambda s: [2 * s, 2 * s + 1]) == [[0, 4, 5], [2, 4, 5]]


def test_cuda_ipc_keeps_each_bucket_alive_until_every_engine_loaded():
    """What gets packed, and the keep-alive: the sender holds the bucket while every engine loads it
    (they read its memory in place) and frees it right after, also when an engine fails."""
    t = CudaIpcTransport()
    buckets = list(plan_buckets(iter(model_tensors()), 3000))
    loads = []

    def load_everywhere(payload):
        assert t.kept == 1                              # alive while the engines read it
        assert payload.device_uuid is None and set(payload.handles) == set(buckets[len(loads)].buffers)
        loads.append([[n for n, _ in t.unpack(payload)] for _engine in range(2)])
        return len(loads)

    assert [t.push(b, load_everywhere) for b in buckets] == list(range(1, len(buckets) + 1))
    assert t.kept == 0                                   # one bucket alive at a time, none after
    assert [names[0] for names in loads] == [b.names for b in buckets] and all(a == b for a, b in loads)

    def engine_dies(payload):
        raise RuntimeError("engine 1 died")

    with pytest.raises(RuntimeError, match="engine 1 died"):
        t.push(buckets[0], engine_dies)
    assert t.kept == 0


def test_push_ipc_drains_the_gather_after_a_failure():
    from megatron_specrl.resync.streams import push_ipc
    pulled = []
    calls = []

    def load_everywhere(payload):
        calls.append(payload)
        if len(calls) == 2:
            raise RuntimeError("engine 0: out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        push_ipc(plan_buckets(recorded_tensors(pulled), 3000), torch.device("cpu"), load_everywhere)
    assert len(calls) == 2 and pulled == [n for n, _ in model_tensors()]   # the other ranks' gather finished






def test_numpy_payload_round_trip_keeps_bf16_and_values():
    named = [("model.layers.0.a", torch.randn(3, 4)), ("model.layers.0.b", torch.randn(5).to(torch.bfloat16)),
             ("lm_head.weight", torch.arange(6, dtype=torch.float32).view(2, 3))]
    back = Bucket.from_payload(Bucket.from_tensors(named).to_payload()).unflatten()
    assert [n for n, _ in back] == [n for n, _ in named]
    for (_, a), (_, b) in zip(named, back):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_plan_casts_to_the_engine_dtype_and_budgets_cast_bytes():
    """A bf16 engine gets bf16 buckets: floating tensors are cast on the way in, the budget counts
    bf16 bytes (half the fp32 ones), and the values are exactly the round-to-nearest bf16 ones."""
    ts = [(n, t.float()) for n, t in model_tensors()]                     # the learner's fp32 state
    fp32_bytes = sum(nbytes(t) for _, t in ts)
    (whole,) = plan_buckets(iter(ts), 1 << 30, dtype="bfloat16")
    assert set(whole.buffers) == {"bfloat16"} and whole.nbytes * 2 == fp32_bytes
    for (n, src), (m, got) in zip(ts, whole.unflatten()):
        assert n == m and got.dtype == torch.bfloat16 and torch.equal(got, src.to(torch.bfloat16))
    assert Bucket.from_payload(whole.to_payload()).buffers["bfloat16"].equal(whole.buffers["bfloat16"])

    budget = fp32_bytes // 2 + 1                         # all of it in bf16, not in fp32
    assert len(list(plan_buckets(iter(ts), budget, dtype="bfloat16"))) == 1
    assert len(list(plan_buckets(iter(ts), budget))) > 1

    ints = [("model.layers.0.idx", torch.arange(4))]     # non-floating tensors keep their dtype
    assert list(plan_buckets(iter(ints), 1 << 30, dtype="bfloat16"))[0].buffers["int64"].equal(torch.arange(4))
    with pytest.raises(ValueError, match="floating torch dtype"):
        list(plan_buckets(iter(ts), 1 << 30, dtype="int8"))


def test_plan_default_and_fp32_are_bit_identical():
    ts = model_tensors()
    for dtype in (None, "float32"):
        got = [t for b in plan_buckets(iter(ts), 3000, dtype=dtype) for _, t in b.unflatten()]
        want = [t for b in plan_buckets(iter(ts), 3000) for _, t in b.unflatten()]
        fp32_in = [t for _, t in ts]
        for a, b, src in zip(got, want, fp32_in):
            if dtype is None:
                assert a.dtype == src.dtype and torch.equal(a, b)
            elif src.dtype == torch.float32:              # fp32 -> fp32 is no cast at all
                assert a.dtype == torch.float32 and torch.equal(a.view(torch.int32), src.view(torch.int32))
