"""Driver side of a sync, per transport: which actor calls run, in which order, and what is checked.

A route moves every bucket of one weight version into every engine (`load`, returning the bucket
count); `resync.lifecycle.sync_weights` wraps it with the wake / finish_update order. `dtype` is the
engines' dtype: learner rank 0 casts to it while bucketing (resync.buckets), the same for every route.

- ObjectStoreRoute ("ray"): rank 0 streams object-store refs; every engine actor reads each one at
  the same time. Waiting for the next bucket of a learner rank times out after `timeout_s`.
- BroadcastRoute ("broadcast"): the resync group (resync.group) is built once and rebuilt when an
  engine was restarted or a sync failed; per sync the engines start receiving, then the learner sends.
  Each group op times out after `timeout_s`; a whole sync must finish within about that too.
- CudaIpcRoute ("cuda_ipc"): learner rank 0 hands IPC handles to the engine actors itself and frees
  each bucket once they have all loaded it (resync.streams.push_ipc).
"""

from __future__ import annotations

import time
from typing import Callable

from megatron_specrl.engines.protocol import InActor
from megatron_specrl.engines.ray_engine import wait_engines
from megatron_specrl.resync import engine_actor
from megatron_specrl.resync.group import ResyncTransportError, first_line

# The driver waits a little longer than the members' own timeouts, so their (more precise) error wins.
GRACE_S = 30.0


def wait_all(waits: dict, timeout_s: float, what: str) -> dict:
    """{ref: (label, get)} -> {ref: result}. The first failure is the one raised, so a dead receiver
    is reported instead of the sender's resulting error (or a timeout), but only once the other
    members have finished too (or the deadline passed): their errors are kept as notes, and nothing
    of a failed sync still runs when the next one starts (a re-join or load queued behind it)."""
    import ray
    pending, out, first = list(waits), {}, None
    deadline = time.monotonic() + timeout_s
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            labels = ", ".join(waits[r][0] for r in pending)
            if first is None:
                raise ResyncTransportError(f"{what}: timed out after {timeout_s:g}s waiting for {labels}")
            first.add_note(f"{what}: still running after {timeout_s:g}s: {labels}")
            break
        for ref in ready:
            try:
                out[ref] = waits[ref][1](ref)
            except Exception as e:
                if first is None:
                    first = e
                else:
                    # a task's error: Ray's wrapper (header line + traceback) around the cause
                    cause = getattr(e, "cause", None)
                    brief = first_line(cause if isinstance(cause, BaseException) else e)
                    first.add_note(f"{what}: {waits[ref][0]} failed too: {brief}")
    if first is not None:
        raise first
    return out


def _ray_engines(targets: list, transport: str) -> list:
    plain = [getattr(e, "name", type(e).__name__) for e in targets if not isinstance(e, InActor)]
    if plain:
        raise ResyncTransportError(f"resync transport {transport} needs engines in Ray actors; "
                                   f"{', '.join(plain)} run in this process (use transport ray)")
    return targets


def _engine_get(engine, what: str) -> Callable:
    return lambda ref: engine.wait(ref, what)     # RayEngine turns actor deaths into EngineError


def _ray_get(ref):
    import ray
    return ray.get(ref)


def bucket_streams(learner, bucket_bytes: int, dtype: str = "float32", miswire: dict | None = None):
    """Start the collective weight gather on every rank of a LearnerGroup of
    resync.learner_actor.RayLearnerWorker actors; returns rank 0's stream of bucket refs (tensors
    cast to `dtype`) and the other ranks' streams (drain them so their generators finish)."""
    # Backpressure: rank 0 packs at most two buckets ahead of the engines.
    streams = [a.hf_bucket_stream.options(num_returns="streaming", _generator_backpressure_num_objects=2)
               .remote(bucket_bytes, dtype, miswire) for a in learner.actors]
    return streams[0], streams[1:]


def load_refs(engine, refs, version: int) -> None:
    """Object store: one RayEngine loads each bucket ref (its actor reads the shared object)."""
    for ref in refs:
        engine.wait(engine_actor.submit(engine, engine_actor.load_payload, ref, version), "update_weights")


class StreamTimeout(ResyncTransportError):
    """A learner rank's bucket stream produced nothing in time (its gather is stuck)."""


def next_ref(stream, timeout_s: float, what: str):
    """The stream's next ref, None at its end. Iterating an ObjectRefGenerator waits forever: a
    learner rank stuck in its gather (dead peer) would hang the run, so the wait is bounded."""
    import ray
    ready, _ = ray.wait([stream], timeout=max(0.0, timeout_s))
    if not ready:
        raise StreamTimeout(f"resync object store: {what} sent nothing for {timeout_s:g}s")
    return next(stream, None)


def drain_streams(streams: list, timeout_s: float, first_rank: int = 0) -> None:
    """Read every stream to its end (the refs are dropped) within timeout_s in all."""
    deadline = time.monotonic() + timeout_s
    for r, stream in enumerate(streams, first_rank):
        while next_ref(stream, deadline - time.monotonic(), f"learner rank {r}") is not None:
            pass


class ObjectStoreRoute:
    name = "ray"

    def __init__(self, timeout_s: float = 600.0):
        self.timeout_s = timeout_s

    def load(self, learner, targets: list, version: int, bucket_bytes: int, dtype: str = "float32",
             miswire: dict | None = None) -> int:
        rank0_stream, other_streams = bucket_streams(learner, bucket_bytes, dtype, miswire)
        n = 0
        try:
            while (ref := next_ref(rank0_stream, self.timeout_s, "learner rank 0")) is not None:
                n += 1
                # Every engine loads the bucket at once (one after another, a sync took N times as
                # long); the next one is taken when all have it, so the object store holds this one
                # and the stream's two ahead. An engine's failure is raised at once, not once the
                # others' loads are done as wait_all does: only engines run these loads, and a failed
                # sync restarts every engine (run.recovery.resync_with_recovery), which kills them.
                wait_engines([(e, engine_actor.submit(e, engine_actor.load_payload, ref, version))
                              for e in targets], "update_weights")
        except BaseException as e:
            # As streams.broadcast_all: read the rest (unused) so rank 0's generator is not left
            # parked on backpressure mid-gather, with every rank's collective and the learner's
            # next call stuck behind it; bounded, and its own errors give way to the first one.
            # Not when rank 0 itself is stuck: that would only wait out a second timeout.
            if not isinstance(e, StreamTimeout):
                try:
                    drain_streams([rank0_stream, *other_streams], self.timeout_s)
                except Exception:
                    pass
            raise
        drain_streams(other_streams, self.timeout_s, first_rank=1)   # let the other ranks' generators finish
        return n


class BroadcastRoute:
    name = "broadcast"

    def __init__(self, timeout_s: float = 600.0):
        self.timeout_s = timeout_s
        self.generation = 0
        self.backend: str | None = None
        self._members: tuple | None = None

    def connect(self, learner, targets: list) -> None:
        """Rendezvous once per set of members: learner rank 0 opens the store, everybody joins."""
        members = (id(learner), tuple((e.name, e.starts) for e in targets))
        if members == self._members:
            return
        import ray
        self._members = None
        self.generation += 1
        rank0 = learner.actors[0]
        host, port = ray.get(rank0.open_resync_store.remote(self.timeout_s), timeout=self.timeout_s)
        world, gen, t = 1 + len(targets), self.generation, self.timeout_s
        waits = {rank0.join_resync_group.remote(host, port, 0, world, gen, t): ("learner rank 0", _ray_get)}
        for i, e in enumerate(targets):
            ref = engine_actor.submit(e, engine_actor.join_group, host, port, i + 1, world, gen, t)
            waits[ref] = (e.name, _engine_get(e, "join_resync_group"))
        joined = wait_all(waits, self.timeout_s + GRACE_S, f"resync broadcast group {gen} at {host}:{port}")
        backends = set(joined.values())
        if len(backends) != 1:
            raise ResyncTransportError(f"resync broadcast: members use different backends {sorted(backends)}")
        self.backend, self._members = backends.pop(), members

    def load(self, learner, targets: list, version: int, bucket_bytes: int, dtype: str = "float32",
             miswire: dict | None = None) -> int:
        targets = _ray_engines(targets, self.name)
        self.connect(learner, targets)
        try:
            # Receivers first: each engine blocks on the first header while the learner gathers.
            recvs = [engine_actor.submit(e, engine_actor.receive_broadcast, version) for e in targets]
            sends = learner.submit("broadcast_buckets", bucket_bytes, dtype, miswire)
            waits = {ref: (e.name, _engine_get(e, "receive_broadcast")) for e, ref in zip(targets, recvs)}
            waits.update({ref: (f"learner rank {r}", _ray_get) for r, ref in enumerate(sends)})
            done = wait_all(waits, self.timeout_s + GRACE_S, f"resync broadcast of version {version}")
        except BaseException:
            self._members = None       # a failed group is not reused: the next sync re-joins
            raise
        sent = int(done[sends[0]]["buckets"])
        for e, ref in zip(targets, recvs):
            if done[ref] != sent:
                self._members = None
                raise ResyncTransportError(f"resync broadcast: {e.name} loaded {done[ref]} buckets, "
                                           f"learner rank 0 sent {sent}")
        return sent


class CudaIpcRoute:
    name = "cuda_ipc"

    def __init__(self, timeout_s: float = 600.0):
        self.timeout_s = timeout_s

    def load(self, learner, targets: list, version: int, bucket_bytes: int, dtype: str = "float32",
             miswire: dict | None = None) -> int:
        targets = _ray_engines(targets, self.name)
        actors = [e.actor for e in targets]
        refs = learner.submit("push_ipc_buckets", bucket_bytes, actors, version, self.timeout_s, dtype, miswire)
        done = wait_all({ref: (f"learner rank {r}", _ray_get) for r, ref in enumerate(refs)},
                        self.timeout_s + GRACE_S, f"resync cuda_ipc of version {version}")
        return int(done[refs[0]]["buckets"])


# Keyed by each route's own name (config.RESYNC_TRANSPORTS lists the same names; tests/test_config checks).
ROUTES = {route.name: route for route in (ObjectStoreRoute, BroadcastRoute, CudaIpcRoute)}


Route = ObjectStoreRoute | BroadcastRoute | CudaIpcRoute


def make_route(name: str, timeout_s: float = 600.0) -> Route:
    if name not in ROUTES:
        raise ValueError(f"unknown resync transport {name!r}; expected one of {sorted(ROUTES)}")
    return ROUTES[name](timeout_s)
