"""Start-up: on CPU the rollout engines build while the learner ranks start and load (and several
engines together), instead of one after the other; with GPUs the order stays ranks first, then
each engine in turn (vLLM sizes its KV cache from the GPU memory it finds free).
"""

from __future__ import annotations
import time
import pytest
from megatron_specrl.config import LearnerConfig, RolloutConfig
from megatron_specrl.engines.protocol import InActor


class _FakeRayEngine:
    """Stands in for RayEngine (declared an engine in an actor, InActor, below): records when it is created
    and when it is waited for."""

    def __init__(self, events, cls, kwargs, name, log_dir, wait=True, **kw):
        self.events, self.name, self.num_gpus = events, name, kw.get("num_gpus")
        events.append(("launch", name, wait))
        if wait:
            self.wait_started()

    def wait_started(self):
        self.events.append(("wait", self.name))


InActor.register(_FakeRayEngine)


def _fake_engines(monkeypatch, events):
    from megatron_specrl.engines import factory, ray_engine
    monkeypatch.setattr(factory, "engine_kwargs", lambda cfg, path, log_dir, i, seed: (object, {"name": f"e{i}",
                                                                                              "log_dir": log_dir}))
    monkeypatch.setattr(ray_engine, "RayEngine", lambda cls, kwargs, **kw: _FakeRayEngine(events, cls, kwargs, **kw))
    return factory


def test_cpu_engines_are_all_launched_before_any_is_waited_for(monkeypatch, tmp_path):
    events = []
    factory = _fake_engines(monkeypatch, events)
    router = factory.make_engine(RolloutConfig(num_engines=3), "m", tmp_path, use_ray=True, gpus_per_engine=0)
    assert events == [("launch", "e0", False), ("launch", "e1", False), ("launch", "e2", False),
                      ("wait", "e0"), ("wait", "e1"), ("wait", "e2")]
    events.clear()
    engine = factory.make_engine(RolloutConfig(), "m", tmp_path, use_ray=True, gpus_per_engine=0, wait=False)
    assert events == [("launch", "e0", False)]      # the caller waits: wait_started
    factory.wait_started(engine)
    factory.wait_started(router)                     # a router: each of its engines (started: no-op here)
    assert events[1] == ("wait", "e0") and len(events) == 5


def test_gpu_engines_still_start_one_after_the_other(monkeypatch, tmp_path):
    events = []
    factory = _fake_engines(monkeypatch, events)
    factory.make_engine(RolloutConfig(num_engines=2), "m", tmp_path, use_ray=True, gpus_per_engine=1.0, wait=False)
    assert events == [("launch", "e0", True), ("wait", "e0"), ("launch", "e1", True), ("wait", "e1")]


@pytest.mark.parametrize("gpu", [False, True])
def test_build_actors_overlaps_the_engine_with_the_learner_groups_on_cpu_only(monkeypatch, tmp_path, gpu):
    from megatron_specrl.cluster import actors
    from megatron_specrl.engines import factory

    events = []

    class Group:
        def __init__(self, settings, seed, role="policy", **kw):
            self.role = role

        def load_hf(self, path):
            events.append(("load_hf", self.role))

    def make_engine(rollout, model_dir, log_dir, use_ray, seed, gpus_per_engine, scheduling, wait=True):
        events.append(("make_engine", wait))
        return "engine"

    monkeypatch.setattr(actors, "LearnerGroup", Group)
    monkeypatch.setattr(actors, "learner_bundles", lambda *a, **kw: ((["b0"], ["b0"], [], 0.5) if gpu
                                                                     else (None, None, [], 0.0)))
    monkeypatch.setattr(factory, "make_engine", make_engine)
    monkeypatch.setattr(factory, "wait_started", lambda e: events.append(("wait_started", e)))
    built = actors.build_actors(tmp_path, LearnerConfig(), RolloutConfig(), seed=0, log_dir=tmp_path,
                                critic_lr=1e-5, reference=True, learner_gpus_per_rank=1.0 if gpu else 0.0,
                                gpus_per_engine=None if gpu else 0)
    loads = [("load_hf", "policy"), ("load_hf", "critic"), ("load_hf", "reference")]
    if gpu:   # unchanged: every learner group loaded, then the engine (colocated: beside their weights)
        assert events == loads + [("make_engine", True)]
    else:
        assert events == [("make_engine", False)] + loads + [("wait_started", "engine")]
    assert built.engine == "engine" and built.critic.role == "critic"


def test_ray_engines_launched_together_build_at_the_same_time_and_a_failed_start_raises_at_the_wait(tmp_path):
    import ray

    from megatron_specrl.cluster.actors import init_ray
    from megatron_specrl.config import RayConfig
    from megatron_specrl.engines.protocol import EngineError
    from megatron_specrl.engines.ray_engine import RayEngine

    class _SlowEngine:   # defined here: Ray pickles it by value (the workers cannot import this module)
        """Each engine marks that it is building, then waits (up to 60 s) for every other engine to mark too:
        a rendezvous, not a timing comparison, so a slow worker start on a loaded machine cannot fail it;
        engines built one after the other would never meet (the first would give up waiting)."""

        def __init__(self, name="", fail=False, meet_dir="", count=1, **kw):
            import pathlib
            if fail:
                time.sleep(1.0)
                raise RuntimeError("engine could not start")
            meet = pathlib.Path(meet_dir)
            (meet / name).touch()
            deadline = time.time() + 60
            while len(list(meet.iterdir())) < count and time.time() < deadline:
                time.sleep(0.05)
            self.met = len(list(meet.iterdir()))

        def others_met(self):
            return self.met

    assert init_ray(RayConfig(num_cpus=2))
    try:
        meet = tmp_path / "meet"
        meet.mkdir()
        engines = [RayEngine(_SlowEngine, {"meet_dir": str(meet), "count": 2}, name=f"e{i}", log_dir=tmp_path,
                             start_timeout_s=120, wait=False)
                   for i in range(2)]
        assert all(e.pid is None for e in engines)
        for e in engines:
            e.wait_started()
        assert all(isinstance(e.pid, int) for e in engines)
        assert [ray.get(e.actor.call.remote("others_met")) for e in engines] == [2, 2]   # both were building at once
        for e in engines:
            e.kill()                      # their CPUs, for the next one
        bad = RayEngine(_SlowEngine, {"fail": True}, name="bad", log_dir=tmp_path, start_timeout_s=120, wait=False)
        with pytest.raises(EngineError, match="start: engine process died"):
            bad.wait_started()
    finally:
        ray.shutdown()
