"""Driver-side resync routes against fake learner ranks and fake engine actors (local Ray, tiny
tensors): every blocking wait is bounded, a failure waits for the other members before it is raised
(so nothing of a failed sync still runs when the next one starts), and a failed object-store sync
still lets the learner's gather finish.
"""

from __future__ import annotations
import threading
import time
from types import SimpleNamespace
import pytest
import torch
from megatron_specrl.engines.protocol import InActor
from megatron_specrl.resync.buckets import Bucket
from megatron_specrl.resync.group import ResyncTransportError
from tests.helpers.ray_session import ray_session_for  # noqa: F401

pytestmark = pytest.mark.slow




@pytest.fixture(scope="module")
def ray_session():
    yield from ray_session_for(__name__)


def _payload(i: int) -> dict:
    return Bucket.from_tensors([(f"model.layers.{i}.w", torch.full((4,), float(i)))]).to_payload()


class _LearnerRank:
    """Stands in for RayLearnerWorker.hf_bucket_stream: rank 0 yields `n` buckets (sleeping `hang_s`
    before bucket `hang_at`), the other ranks yield nothing (or sleep first)."""

    def __init__(self, rank: int, n: int, hang_at: int | None = None, hang_s: float = 0.0):
        self.rank, self.n, self.hang_at, self.hang_s = rank, n, hang_at, hang_s
        self.pulled = 0

    def hf_bucket_stream(self, bucket_bytes, dtype, miswire):
        for i in range(self.n if self.rank == 0 else 0):
            if i == self.hang_at:
                time.sleep(self.hang_s)
            self.pulled += 1
            yield _payload(i)
        if self.rank != 0 and self.hang_at is not None:
            time.sleep(self.hang_s)

    def pulled_count(self) -> int:
        return self.pulled


class _Engine:
    def __init__(self, fail_at: int | None = None):
        self.fail_at, self.loaded = fail_at, []

    def update_weights(self, named, version):
        i = int(named[0][1][0])
        if i == self.fail_at:
            raise RuntimeError(f"engine failed loading bucket {i}")
        self.loaded.append(i)


class _EngineActor:
    def __init__(self, fail_at=None):
        self.engine = _Engine(fail_at)

    def loaded(self):
        return self.engine.loaded


class _RayEngine(InActor):
    """The part of engines.ray_engine.RayEngine that the routes use (an engine in an actor: InActor)."""

    timeout_s = 30.0

    def __init__(self, ray, name, fail_at=None):
        self.ray, self.name, self.starts = ray, name, 1
        self.actor = ray.remote(num_cpus=0)(_EngineActor).remote(fail_at)
        # started, as a run's engines are before any resync: a worker process's start-up (seconds on a
        # loaded machine) is not part of the route's bounded waits
        ray.get(self.actor.loaded.remote(), timeout=120)

    def submit_actor(self, method, *args):
        return getattr(self.actor, method).remote(*args)

    def wait(self, ref, what, expected_version=None, deadline=None):
        return self.ray.get(ref, timeout=self.timeout_s if deadline is None else max(0.0, deadline - time.monotonic()))

    def submit(self, method, *args):
        raise AssertionError("the routes start the actor's own methods (submit_actor), not engine calls")

    def restart(self):
        raise AssertionError("the routes never restart an engine")

    def wait_started(self):
        pass


def _learner(ray, ranks: list[_LearnerRank]):
    cls = ray.remote(num_cpus=0)(_LearnerRank)
    actors = [cls.remote(r.rank, r.n, r.hang_at, r.hang_s) for r in ranks]
    ray.get([a.pulled_count.remote() for a in actors], timeout=120)   # started: a run's learner is up
    return SimpleNamespace(actors=actors)


def _in_thread(fn, limit_s: float):
    """fn() -> ('ok', result) | ('raised', exc) | ('hung', None) after limit_s."""
    out = []

    def run():
        try:
            out.append(("ok", fn()))
        except BaseException as e:      # noqa: BLE001 - reported to the test
            out.append(("raised", e))
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(limit_s)
    return out[0] if out else ("hung", None)


def _kill(ray, *handles):
    for h in handles:
        ray.kill(h)


def test_object_store_route_loads_every_bucket_into_every_engine(ray_session):
    from megatron_specrl.resync.routes import make_route
    ray = ray_session
    learner = _learner(ray, [_LearnerRank(0, 3), _LearnerRank(1, 3)])
    engines = [_RayEngine(ray, "e0"), _RayEngine(ray, "e1")]
    assert make_route("ray", timeout_s=10).load(learner, engines, 1, 1 << 20) == 3
    assert [ray.get(e.actor.loaded.remote()) for e in engines] == [[0, 1, 2], [0, 1, 2]]
    _kill(ray, *learner.actors, *(e.actor for e in engines))


@pytest.mark.parametrize("hung_rank", [0, 1])
def test_object_store_route_times_out_on_a_hung_learner_rank(ray_session, hung_rank):
    """A learner rank that stops producing (stuck collective, dead peer) is an error after the
    route's timeout, not a run that waits forever."""
    from megatron_specrl.resync.routes import make_route
    ray = ray_session
    ranks = [_LearnerRank(0, 3, hang_at=1 if hung_rank == 0 else None, hang_s=60),
             _LearnerRank(1, 3, hang_at=0 if hung_rank == 1 else None, hang_s=60)]
    learner = _learner(ray, ranks)
    engines = [_RayEngine(ray, "e0")]
    route = make_route("ray", timeout_s=2)
    t0 = time.monotonic()
    status, err = _in_thread(lambda: route.load(learner, engines, 1, 1 << 20), 20)
    _kill(ray, *learner.actors, *(e.actor for e in engines))
    assert status == "raised", f"route.load {status} (a hung learner rank must time out)"
    assert isinstance(err, ResyncTransportError) and "2s" in str(err) and f"learner rank {hung_rank}" in str(err)
    assert time.monotonic() - t0 < 15


def test_object_store_route_lets_the_gather_finish_after_an_engine_failure(ray_session):
    """An engine failing on bucket 1 fails the sync; rank 0's stream is still read to its end so
    every rank's collective gather finishes and the learner takes calls again (the same rule as
    streams.broadcast_all / push_ipc)."""
    from megatron_specrl.resync.routes import make_route
    ray = ray_session
    n = 8                                             # more than the stream's backpressure of 2
    learner = _learner(ray, [_LearnerRank(0, n), _LearnerRank(1, n)])
    engines = [_RayEngine(ray, "e0", fail_at=1)]
    status, err = _in_thread(lambda: make_route("ray", timeout_s=10).load(learner, engines, 1, 1 << 20), 30)
    assert status == "raised" and "bucket 1" in str(err)
    try:
        pulled = ray.get(learner.actors[0].pulled_count.remote(), timeout=10)
    except ray.exceptions.GetTimeoutError:
        pulled = None                                  # rank 0 still stuck in its generator
    _kill(ray, *learner.actors, *(e.actor for e in engines))
    assert pulled == n


def test_wait_all_waits_for_the_others_after_a_failure(ray_session, tmp_path):
    """The first failure is what is raised, but only once every other member has finished (or the
    deadline passed): their errors are kept as notes and none of them still runs into the next sync."""
    from megatron_specrl.resync.routes import wait_all
    ray = ray_session

    @ray.remote(num_cpus=0)
    def fails_now():
        raise RuntimeError("engine 0 died")

    @ray.remote(num_cpus=0)
    def fails_later(path):
        time.sleep(1.5)
        open(path, "w").close()
        raise RuntimeError("learner rank 0: peer closed")

    marker = tmp_path / "later-finished"
    first, later = fails_now.remote(), fails_later.remote(str(marker))
    get = lambda ref: ray.get(ref)                     # noqa: E731
    with pytest.raises(Exception, match="engine 0 died") as info:
        wait_all({first: ("engine 0", get), later: ("learner rank 0", get)}, 20, "sync")
    assert marker.exists()                             # the other member finished before the raise
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "learner rank 0" in notes and "peer closed" in notes

    @ray.remote(num_cpus=0)
    def hangs():
        time.sleep(30)

    stuck = hangs.remote()
    t0 = time.monotonic()
    with pytest.raises(Exception, match="engine 0 died") as info:
        wait_all({fails_now.remote(): ("engine 0", get), stuck: ("engine 1", get)}, 2, "sync")
    assert time.monotonic() - t0 < 10                  # still bounded by the deadline
    assert "engine 1" in "\n".join(getattr(info.value, "__notes__", []))
    ray.cancel(stuck, force=True)


def test_cuda_ipc_bucket_is_kept_until_every_engine_returned(ray_session, tmp_path):
    """One engine failing at once must not release the bucket while another still reads it: the
    learner waits for every engine's load (bounded) before the bucket is freed."""
    from megatron_specrl.resync.learner_actor import RayLearnerWorker
    ray = ray_session

    class IpcEngine:
        def __init__(self, fail: bool, marker: str):
            self.fail, self.marker = fail, marker

        def update_weights_in_workers(self, load, kwargs, version):
            if self.fail:
                raise RuntimeError("engine 0: out of memory")
            time.sleep(1.5)
            open(self.marker, "w").close()
            return 1

    class Holder:
        def __init__(self, fail, marker):
            self.engine = IpcEngine(fail, marker)

        def ready(self):
            return True

    marker = tmp_path / "slow-engine-done"
    actors = [ray.remote(num_cpus=0)(Holder).remote(True, str(marker)),
              ray.remote(num_cpus=0)(Holder).remote(False, str(marker))]
    # started before the 20 s sync begins, as a run's engines are: on a loaded machine (the suite on two
    # workers) starting two actor processes alone took longer than that
    ray.get([a.ready.remote() for a in actors], timeout=120)
    released = []

    def buckets(*_):
        yield Bucket.from_tensors([("model.layers.0.w", torch.ones(4))])

    from megatron_specrl.resync import streams
    orig = streams.CudaIpcTransport.release

    def release(self):
        released.append(marker.exists())              # was the slow engine done when freed?
        orig(self)

    fake = SimpleNamespace(rank=0, device=torch.device("cpu"), _buckets=buckets)
    streams.CudaIpcTransport.release = release
    try:
        with pytest.raises(Exception, match="out of memory"):
            RayLearnerWorker.push_ipc_buckets(fake, 1 << 20, actors, 1, 20)
    finally:
        streams.CudaIpcTransport.release = orig
        _kill(ray, *actors)
    assert released == [True]


def test_nccl_group_close_destroys_the_communicator():
    """A regroup (engine restart, failed sync) must free the old NCCL communicator, not only drop
    the Python reference (vLLM's PyNcclCommunicator has no finalizer)."""
    from megatron_specrl.resync.group import PyncclGroup
    destroyed = []
    g = PyncclGroup.__new__(PyncclGroup)
    g.comm, g.meta = SimpleNamespace(destroy=lambda: destroyed.append(True)), object()
    g.close()
    g.close()                                          # idempotent
    assert destroyed == [True] and g.comm is None
