"""Review of engine recovery: why an engine died (the one line the user reads), and a second failure
inside the retry ending the run with the CLI's one engine-error line. Fakes only (no engine starts, no
Ray cluster)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_specrl.engines.protocol import EngineError
from megatron_specrl.resync.group import ResyncTransportError
from megatron_specrl.run_setup import resync_with_recovery, with_engine_recovery
from test_review_engines_router import T1, reqs, ray_engine  # noqa: F401  (ray_engine: a fixture)

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


def test_an_engine_that_dies_while_starting_names_no_pid_of_none(ray_engine):  # noqa: F811
    """Bug: a (re)start whose actor died before it answered its pid read `engine process died (pid None)`."""
    from ray.exceptions import ActorDiedError

    ray_engine._pid = None
    with pytest.raises(EngineError) as ei:
        ray_engine._get(ActorDiedError(), 1.0, "start")
    first = str(ei.value).splitlines()[0]
    assert first.startswith("[vllm-3] start: engine process died: The actor died") and "None" not in first
    ray_engine._pid = 4242   # a running engine keeps its pid in the line
    with pytest.raises(EngineError, match=r"^\[vllm-3\] generate: engine process died \(pid 4242\): "):
        ray_engine._get(ActorDiedError(), 1.0, "generate")


def test_a_hung_engine_times_out_into_an_engine_error(ray_engine, monkeypatch):  # noqa: F811
    """Pins (no bug): rollout.engine_timeout_s turns a hung call into the EngineError recovery restarts on."""
    import ray
    from ray.exceptions import GetTimeoutError

    def hung(ref, timeout=None):
        raise GetTimeoutError("Get timed out")

    monkeypatch.setattr(ray, "get", hung)
    ray_engine.actor = SimpleNamespace(call=SimpleNamespace(remote=lambda *a: "ref"))
    with pytest.raises(EngineError, match=r"^\[vllm-3\] generate timed out after 600s"):
        ray_engine.generate(reqs(2), T1, 0)


class Engine:
    def __init__(self, name, events):
        self.name, self.events = name, events

    def restart(self):
        self.events.append(("restart", self.name))


def _run(tmp_path, events, resync, version=5):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "checkpoints" / "step_000001").mkdir(parents=True)
    return SimpleNamespace(cfg=SimpleNamespace(rollout=SimpleNamespace(draft="none")), version=version,
                           out=tmp_path, engine=SimpleNamespace(engines=[Engine("vllm-0", events),
                                                                         Engine("vllm-1", events)]),
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
