"""Waiting on several engines at once: the router's fan-out and the object-store resync.

Both submitted to every engine and then waited on each in turn, so an engine that died (or raised)
while the one before it was still busy for minutes was reported only once that one had finished,
and the object-store route loaded each bucket into one engine after another (N engines, N times the
sync). Real RayEngine handles over fake engines in their actors (local Ray, no model), plus the
in-process router's threads. The time bounds are behavioural (well under the slow engine's 20 s),
not benchmarks.
"""

from __future__ import annotations
import json
import os
import threading
import time
from types import SimpleNamespace
import pytest
import torch
from megatron_specrl.engines.protocol import EngineError, GenerateRequest, GenerateResult, SamplingSettings
from megatron_specrl.engines.router import EngineRouter
from tests.helpers.ray_session import ray_session_for

pytestmark = pytest.mark.slow

T1 = SamplingSettings()
SLOW_S = 20.0


@pytest.fixture(scope="module")
def ray_session():
    yield from ray_session_for(__name__)


class FakeEngine:
    """Runs in a real EngineActor: every generate / update_weights call sleeps `delay_s`, then
    answers, raises the engine's own EngineError (`fail="raise"`) or kills the process (`"die"`).
    Loads are recorded as JSON lines in `record` (a file shared by the engines)."""

    def __init__(self, name, log_dir, delay_s=0.0, fail=None, record=None):
        self.name, self.delay_s, self.fail, self.record = name, delay_s, fail, record
        self.weight_version = 0

    def _act(self):
        time.sleep(self.delay_s)
        if self.fail == "raise":
            raise EngineError("EngineDeadError: engine core died", self.name)
        if self.fail == "die":
            os._exit(1)

    def generate(self, requests, sampling, weight_version):
        self._act()
        return [GenerateResult([r.prompt_ids[0]], [-1.0], "length", weight_version=weight_version)
                for r in requests]

    def update_weights(self, named, version):
        start = time.time()
        self._act()
        with open(self.record, "a") as f:
            f.write(json.dumps({"engine": self.name, "bucket": int(named[0][1][0]), "start": start,
                                "end": time.time()}) + "\n")

    def shutdown(self):
        pass


def _engines(tmp_path, specs: list[dict], timeout_s: float = 60.0) -> list:
    from megatron_specrl.engines.ray_engine import RayEngine
    return [RayEngine(FakeEngine, spec, name=f"fake-{i}", log_dir=tmp_path, num_cpus=0,
                      timeout_s=spec.pop("timeout_s", timeout_s)) for i, spec in enumerate(specs)]


def _kill(engines):
    for e in engines:
        e.kill()


def reqs(n):
    return [GenerateRequest([i], 4) for i in range(n)]


# -- router ----------------------------------------------------------------------------------
def test_ray_router_merges_results_in_the_callers_order(ray_session, tmp_path):
    """The engine answering last holds the first shard: the results still come back in order."""
    engines = _engines(tmp_path, [dict(delay_s=1.0), dict(delay_s=0.0)])
    try:
        out = EngineRouter(engines).generate(reqs(6), T1, 0)
    finally:
        _kill(engines)
    assert [r.token_ids[0] for r in out] == list(range(6)) and {r.weight_version for r in out} == {0}


@pytest.mark.parametrize("fail, message", [("raise", r"^\[fake-1\] EngineDeadError: engine core died"),
                                           ("die", r"^\[fake-1\] generate: engine process died")])
def test_ray_router_reports_a_failing_engine_while_another_still_generates(ray_session, tmp_path, fail, message):
    """Engine 1 fails after 0.2 s while engine 0 generates for 20 s: its error (translated by its own
    RayEngine.wait: the engine's EngineError, or the death with its cause) arrives at once."""
    engines = _engines(tmp_path, [dict(delay_s=SLOW_S), dict(delay_s=0.2, fail=fail)])
    t0 = time.monotonic()
    try:
        with pytest.raises(EngineError, match=message) as ei:
            EngineRouter(engines).generate(reqs(2), T1, 0)
        elapsed = time.monotonic() - t0
    finally:
        _kill(engines)
    assert ei.value.engine == "fake-1"
    assert elapsed < 10, f"the failure surfaced after {elapsed:.1f}s, behind the slow engine"


def test_ray_router_times_out_each_engine_on_its_own_timeout(ray_session, tmp_path):
    """engine_timeout_s bounds each engine's call from its submit, as a lone RayEngine.generate: a hung
    engine 1 (timeout 1 s) is reported as its own timeout, not after engine 0's 20 s batch."""
    engines = _engines(tmp_path, [dict(delay_s=SLOW_S), dict(delay_s=SLOW_S, timeout_s=1.0)])
    t0 = time.monotonic()
    try:
        with pytest.raises(EngineError, match=r"^\[fake-1\] generate timed out after 1s") as ei:
            EngineRouter(engines).generate(reqs(2), T1, 0)
        elapsed = time.monotonic() - t0
    finally:
        _kill(engines)
    assert ei.value.engine == "fake-1" and 0.9 < elapsed < 10


def test_in_process_router_reports_a_failure_without_waiting_for_the_slow_engine():
    release = threading.Event()

    class Slow:
        name = "slow"

        def generate(self, requests, sampling, weight_version):
            release.wait(SLOW_S)
            return [GenerateResult([r.prompt_ids[0]], [-1.0], "length", weight_version=weight_version)
                    for r in requests]

    class Failing:
        name = "failing"

        def generate(self, requests, sampling, weight_version):
            time.sleep(0.2)
            raise EngineError("EngineDeadError: engine core died", self.name)

    t0 = time.monotonic()
    try:
        with pytest.raises(EngineError, match=r"^\[failing\]"):
            EngineRouter([Slow(), Failing()]).generate(reqs(2), T1, 0)
        elapsed = time.monotonic() - t0
    finally:
        release.set()                   # the slow engine's thread finishes in the background
    assert elapsed < 10, f"the failure surfaced after {elapsed:.1f}s, behind the slow engine"


# -- object-store resync ---------------------------------------------------------------------
class LearnerRank:
    """Stands in for RayLearnerWorker.hf_bucket_stream on learner rank 0: `n` one-tensor buckets,
    bucket i's tensor filled with i."""

    def __init__(self, n: int):
        self.n = n

    def hf_bucket_stream(self, bucket_bytes, dtype, miswire):
        from megatron_specrl.resync.buckets import Bucket
        for i in range(self.n):
            yield Bucket.from_tensors([(f"model.layers.{i}.w", torch.full((4,), float(i)))]).to_payload()

    def ready(self) -> bool:
        return True


def _learner(ray, n: int):
    rank0 = ray.remote(num_cpus=0)(LearnerRank).remote(n)
    ray.get(rank0.ready.remote(), timeout=60)
    return SimpleNamespace(actors=[rank0])


def _loads(record) -> list[dict]:
    return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []


def test_object_store_route_loads_a_bucket_into_every_engine_at_once(ray_session, tmp_path):
    """Both engines' loads of a bucket overlap (each takes 1 s), and every bucket reaches every engine."""
    from megatron_specrl.resync.routes import make_route
    record = tmp_path / "loads.jsonl"
    learner = _learner(ray_session, 2)
    engines = _engines(tmp_path, [dict(delay_s=1.0, record=str(record)), dict(delay_s=1.0, record=str(record))])
    try:
        assert make_route("ray", timeout_s=30).load(learner, engines, 1, 1 << 20) == 2
    finally:
        _kill(engines)
        ray_session.kill(learner.actors[0])
    loads = _loads(record)
    assert sorted((r["engine"], r["bucket"]) for r in loads) == [("fake-0", 0), ("fake-0", 1),
                                                                  ("fake-1", 0), ("fake-1", 1)]
    for bucket in (0, 1):
        mine = [r for r in loads if r["bucket"] == bucket]
        assert max(r["start"] for r in mine) < min(r["end"] for r in mine), f"bucket {bucket}: loads in turn"
    # the next bucket is taken once every engine has the last one
    assert max(r["end"] for r in loads if r["bucket"] == 0) <= min(r["start"] for r in loads if r["bucket"] == 1)


@pytest.mark.parametrize("fail, message", [("raise", r"^\[fake-1\] EngineDeadError: engine core died"),
                                           ("die", r"^\[fake-1\] update_weights: engine process died")])
def test_object_store_route_reports_a_failing_engine_during_another_ones_slow_load(ray_session, tmp_path,
                                                                                   fail, message):
    from megatron_specrl.resync.routes import make_route
    learner = _learner(ray_session, 3)
    record = str(tmp_path / "loads.jsonl")
    engines = _engines(tmp_path, [dict(delay_s=SLOW_S, record=record),
                                  dict(delay_s=0.2, fail=fail, record=record)])
    t0 = time.monotonic()
    try:
        with pytest.raises(EngineError, match=message):
            make_route("ray", timeout_s=30).load(learner, engines, 1, 1 << 20)
        elapsed = time.monotonic() - t0
    finally:
        _kill(engines)
        ray_session.kill(learner.actors[0])
    assert elapsed < 10, f"the failure surfaced after {elapsed:.1f}s, behind the slow engine's load"
