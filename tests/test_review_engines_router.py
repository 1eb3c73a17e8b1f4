"""Review of the engine layer's failure reporting: an engine that answers a wrong number of results, an
error raised inside the engine's actor, a version mismatch behind a router, and a malformed
fault-injection variable. Fakes only (no engine starts, no Ray cluster)."""

from __future__ import annotations

import traceback

import pytest

from megatron_specrl import faults
from megatron_specrl.engines.protocol import (
    EngineError, EngineHealth, GenerateRequest, GenerateResult, SamplingSettings, ScoreRequest, ScoreResult,
    WeightVersionMismatch,
)
from megatron_specrl.engines.router import EngineRouter

T1 = SamplingSettings()


class Fake:
    """In-process engine; `drop` results fewer (negative: more) than requests."""

    def __init__(self, name, drop=0, answer_version=None):
        self.name, self.weight_version, self.drop, self.answer_version = name, 0, drop, answer_version

    def _version(self, weight_version):
        return weight_version if self.answer_version is None else self.answer_version

    def generate(self, requests, sampling, weight_version):
        out = [GenerateResult([r.prompt_ids[0]], [-1.0], "length", weight_version=self._version(weight_version))
               for r in requests]
        return out[:len(out) - self.drop] if self.drop >= 0 else out + out[:-self.drop]

    def score(self, requests, sampling, weight_version):
        out = [ScoreResult([-1.0] * len(r.continuation_ids), self._version(weight_version)) for r in requests]
        return out[:len(out) - self.drop] if self.drop >= 0 else out + out[:-self.drop]

    def health(self):
        return EngineHealth(True, self.weight_version)


def reqs(n):
    return [GenerateRequest([i], 4 + i) for i in range(n)]


@pytest.mark.parametrize("drop", [1, -1])
def test_router_refuses_an_engine_answering_a_wrong_number_of_results(drop):
    """An engine answering 3 of 4 requests left None in the merged results (the rollout then failed far
    away, or silently dropped a sample); an extra result was dropped. Either is named at the engine."""
    router = EngineRouter([Fake("e0"), Fake("e1", drop=drop)])
    with pytest.raises(EngineError, match=r"^\[e1\] generate: .* results for .* requests"):
        router.generate(reqs(8), T1, 0)
    scores = [ScoreRequest([i], [1, 2]) for i in range(8)]
    with pytest.raises(EngineError, match=r"^\[e1\] score: "):
        router.score(scores, T1, 0)


def test_router_version_mismatch_names_the_engine():
    with pytest.raises(WeightVersionMismatch, match="e1"):
        EngineRouter([Fake("e0"), Fake("e1", answer_version=7)]).generate(reqs(8), T1, 0)


# -- RayEngine over a fake actor -------------------------------------------------------
class _Remote:
    def __init__(self, fn):
        self.remote = fn


class FakeActor:
    def __init__(self, answer):
        self.call = _Remote(lambda method, *args: ("ref", answer(method, *args)))


@pytest.fixture
def ray_engine(monkeypatch, tmp_path):
    import ray

    from megatron_specrl.engines.ray_engine import RayEngine

    monkeypatch.setattr(RayEngine, "start", lambda self: None)
    def fake_get(ref, timeout=None):
        if isinstance(ref, BaseException):
            raise ref
        return ref[1]

    monkeypatch.setattr(ray, "get", fake_get)
    return RayEngine(object, {}, "vllm-3", tmp_path)


def test_ray_engine_refuses_a_wrong_number_of_results(ray_engine):
    ray_engine.actor = FakeActor(lambda method, requests, s, v: Fake("x", drop=1).generate(requests, s, v))
    with pytest.raises(EngineError, match=r"^\[vllm-3\] generate: 2 results for 3 requests"):
        ray_engine.generate(reqs(3), T1, 0)


def _in_actor(exc):
    """What ray.get raises for an exception raised inside the actor's method."""
    from ray.exceptions import RayTaskError
    try:
        raise exc
    except type(exc) as cause:
        return RayTaskError("call", "".join(traceback.format_exception(cause)), cause,
                            proctitle="ray::EngineActor.call()", pid=123, ip="10.0.0.1").as_instanceof_cause()


@pytest.mark.parametrize("exc, first", [
    (EngineError("EngineDeadError: EngineCore died", "vllm-3", ["a log line"]),
     "[vllm-3] EngineDeadError: EngineCore died"),
    (WeightVersionMismatch("engine vllm-3 serves weight version 0, caller expects 2"),
     "engine vllm-3 serves weight version 0, caller expects 2"),
])
def test_an_error_raised_inside_the_actor_keeps_its_one_line_message(ray_engine, exc, first):
    """The engine's own EngineError (vLLM's engine core died, OOM inside vLLM) came back wrapped by Ray:
    its first line was Ray's `ray::EngineActor.call() (pid=..., ip=...)`, which is what
    with_engine_recovery logs and what the user reads, not the engine and the problem."""
    wrapped = _in_actor(exc)
    assert str(wrapped).splitlines()[0] != first        # what Ray hands over
    ray_engine.actor = FakeActor(lambda *a: None)
    ray_engine.actor.call = _Remote(lambda *a: wrapped)
    with pytest.raises(type(exc)) as ei:
        ray_engine.generate(reqs(1), T1, 0)
    assert str(ei.value).splitlines()[0] == first
    if isinstance(exc, EngineError):
        assert ei.value.engine == "vllm-3" and ei.value.last_log_lines == ["a log line"]


# -- fault injection -------------------------------------------------------------------
@pytest.mark.parametrize("environ", [
    {faults.ENV: "train"}, {faults.ENV: "train:x"}, {faults.ENV: "train-3"},
    {faults.ENGINE_ENV: "rollout:x"}, {faults.ENGINE_ENV: "rollot:2"}, {faults.ENGINE_ENV: "two"},
])
def test_a_malformed_kill_variable_fails_loudly(environ):
    """A typo turned the crash test into a run without a crash, which then passed."""
    with pytest.raises(ValueError, match="SPECRL_KILL"):
        faults.from_env(environ=environ)


# -- recovery --------------------------------------------------------------------------
def test_recovery_restarts_every_engine_and_pushes_the_current_weights_before_the_retry(tmp_path):
    """A router's engine dies at weight version 3: every engine restarts (version 0 again), gets version
    3 before the retry serves anything, and the retry finds the store as the first attempt did."""
    from types import SimpleNamespace

    from megatron_specrl.data.datasets import PromptLoader, PromptRecord
    from megatron_specrl.rollout.store import Trajectory, TrajectoryStore
    from megatron_specrl.run_setup import with_engine_recovery

    events = []

    class Restartable:
        def __init__(self, name):
            self.name = name

        def restart(self):
            events.append(("restart", self.name))

    store = TrajectoryStore()
    store.put("p0", 0, Trajectory([1, 2], [-0.5, -0.5], "stop", 2))
    run = SimpleNamespace(cfg=SimpleNamespace(rollout=SimpleNamespace(draft="none")), version=3, out=tmp_path,
                          loader=PromptLoader([PromptRecord(id=f"p{i}", prompt="x", answer="y") for i in range(4)],
                                              batch_size=2, seed=0),
                          store=store, engine=SimpleNamespace(engines=[Restartable("e0"), Restartable("e1")]),
                          resync=lambda: events.append(("resync", run.version)))

    def collect():
        events.append(("collect", store.get("p0", 0).token_ids))
        store.put("p0", 0, Trajectory([9], [-0.1], "stop", 3))
        if sum(e[0] == "collect" for e in events) == 1:
            raise EngineError("generate: engine process died (pid 1)", "e1")
        return [], None, {}

    with_engine_recovery(run, 4, collect)
    assert events == [("collect", [1, 2]), ("restart", "e0"), ("restart", "e1"), ("resync", 3),
                      ("collect", [1, 2])]


def test_an_engine_error_crosses_a_process_boundary_unchanged():
    """Raised in the engine's actor, it reaches the driver pickled: the copy was built from its formatted
    message alone and read `[] [vllm-3] ...` (with the log tail twice over where the engine was named)."""
    import pickle

    import cloudpickle

    err = EngineError("EngineDeadError: EngineCore died", "vllm-3", ["a log line"])
    for m in (pickle, cloudpickle):
        copy = m.loads(m.dumps(err))
        assert (str(copy), copy.engine, copy.last_log_lines) == (str(err), "vllm-3", ["a log line"])
