"""A rollout engine inside a Ray actor, driven through the same protocol.

The actor owns one engine (VLLMEngine in-process mode, so the actor's pid *is*
the engine; on GPU with TP > 1 vLLM spawns its TP workers under it). The
driver-side `RayEngine` turns the ways an actor fails (process died, timeout,
OOM-killed) into `EngineError` carrying the engine's last log lines, read from
the log file the engine writes, so the caller can `restart()` and retry the batch.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any, Iterable

import torch

from megatron_specrl.engines.protocol import (
    DraftResponse, DraftsFromTrees, EngineCapabilities, EngineError, EngineHealth, GenerateRequest, GenerateResult,
    InActor, RunsInWorkers, SamplingSettings, ScoreRequest, ScoreResult, SleepsWhileTraining, WeightVersionMismatch,
    check_count, samples_coupled, verifies_processed_distribution,
)
from megatron_specrl.engines.logs import tail_lines

ACTOR_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}


def cpu_thread_env(binding: str | None) -> dict[str, str]:
    """The OpenMP threads of a CPU engine's actor. vLLM applies VLLM_CPU_OMP_THREADS_BIND only to the worker
    processes it spawns; our engines run in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so a one-worker
    binding ("4,5") is applied here, before the actor's torch starts its thread pool: that many threads,
    pinned to those CPUs (GOMP_CPU_AFFINITY, the GNU OpenMP of torch's CPU wheel). Without a binding, every
    core of the node."""
    if binding and binding not in ("auto", "nobind") and "|" not in binding:
        cpus = [c for c in binding.split(",") if c.strip()]
        return {"OMP_NUM_THREADS": str(len(cpus)), "GOMP_CPU_AFFINITY": " ".join(cpus)}
    return {"OMP_NUM_THREADS": str(os.cpu_count() or 1)}


class EngineActor:
    """Runs in the actor process: builds the engine and forwards protocol calls. Weight syncs run
    resync.engine_actor's functions in here through Ray's `__ray_call__`."""

    def __init__(self, engine_cls, engine_kwargs: dict):
        for k, v in ACTOR_ENV.items():
            os.environ.setdefault(k, v)
        self.engine = engine_cls(**engine_kwargs)

    def pid(self) -> int:
        return os.getpid()

    def call(self, method: str, *args, **kwargs):
        return getattr(self.engine, method)(*args, **kwargs)

    def weight_version(self) -> int:
        return self.engine.weight_version



class RayEngine(EngineCapabilities, DraftsFromTrees, SleepsWhileTraining, RunsInWorkers, InActor):
    """Driver-side handle implementing RolloutEngine over an EngineActor. Its capabilities are its
    engine class's: the flags are read from the class, the draft trees' and workers' calls forwarded
    to an engine class that declares them (the draft trees' answer nothing for one that does not),
    memory released and resumed in the engine."""

    def __init__(self, engine_cls, engine_kwargs: dict, name: str, log_dir: str | Path,
                 num_cpus: float = 1, num_gpus: float = 0, timeout_s: float = 600.0,
                 start_timeout_s: float = 600.0, scheduling_strategy=None, wait: bool = True):
        """`wait=False`: create the actor and return while its engine builds; `wait_started()` then
        waits for it (and raises what a failed start raises)."""
        self.name = name
        self.scheduling_strategy = scheduling_strategy   # a placement group bundle (actors.build_actors)
        self.engine_cls = engine_cls
        self.engine_kwargs = dict(engine_kwargs, name=name, log_dir=str(log_dir))
        self.log_path = Path(log_dir) / f"{name}.log"
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self.actor = None
        self._pid: int | None = None
        self.starts = 0          # a new actor process is a new member of any broadcast group
        if wait:
            self.start()
        else:
            self.launch()

    # -- lifecycle --------------------------------------------------------------
    def start(self) -> None:
        self.launch()
        self.wait_started()

    def launch(self) -> None:
        """Create the engine's actor without waiting for the engine to build (Ray creates actors
        asynchronously): several engines, or an engine and the learner ranks, then start together."""
        import ray

        where = {"scheduling_strategy": self.scheduling_strategy} if self.scheduling_strategy is not None else {}
        cls = ray.remote(EngineActor).options(
            num_cpus=self.num_cpus, num_gpus=self.num_gpus, max_restarts=0, max_concurrency=1,
            runtime_env={"env_vars": self._actor_env()}, **where)
        self.actor = cls.remote(self.engine_cls, self.engine_kwargs)
        self.starts += 1
        self._pid = None

    def wait_started(self) -> None:
        """Wait until the launched engine has built (its pid answers once its __init__ returned)."""
        if self._pid is None:
            self._pid = self._get(self._running_actor().pid.remote(), self.start_timeout_s, "start")

    def _actor_env(self) -> dict:
        """Ray pins OMP_NUM_THREADS to the actor's num_cpus (1 here); a CPU engine would then
        decode on one core while the learner sits idle during rollouts. Give it the node's cores."""
        env = dict(ACTOR_ENV)
        if not self.num_gpus:
            env.update(cpu_thread_env(os.environ.get("VLLM_CPU_OMP_THREADS_BIND")))
        return env

    def restart(self) -> None:
        """Kill the actor (if still alive) and start a fresh engine from `model_path`:
        it serves version 0 again, so the caller re-pushes the current weights."""
        self.kill()
        self.start()

    def kill(self) -> None:
        import ray
        if self.actor is not None:
            try:
                ray.kill(self.actor, no_restart=True)
            except Exception:  # already gone
                pass
        self.actor, self._pid = None, None

    def shutdown(self) -> None:
        import ray
        if self.actor is not None:
            try:
                ray.get(self.actor.call.remote("shutdown"), timeout=60)
            except Exception:
                pass
        self.kill()

    @property
    def pid(self) -> int | None:
        return self._pid

    # -- protocol -----------------------------------------------------------------
    @property
    def verifies_processed_distribution(self) -> bool:
        """The engine class's capability (a class attribute: no call into the actor)."""
        return verifies_processed_distribution(self.engine_cls)

    @property
    def samples_coupled(self) -> bool:
        return samples_coupled(self.engine_cls)

    @property
    def weight_version(self) -> int:
        return self._get(self._running_actor().weight_version.remote(), self.timeout_s, "weight_version")

    def submit(self, method: str, *args):
        """Start a call without waiting (the router overlaps engines with this)."""
        return self._running_actor().call.remote(method, *args)

    def _running_actor(self):
        if self.actor is None:
            raise EngineError("engine is not running (call restart())", self.name, self.last_log_lines())
        return self.actor

    def wait(self, ref, what: str, expected_version: int | None = None, deadline: float | None = None):
        """`deadline` (time.monotonic()): the end of this call's timeout_s when it started counting
        before this wait (wait_engines waits on several engines at once); None: timeout_s from now."""
        out = self._get(ref, self.timeout_s, what, deadline)
        if expected_version is not None:
            for r in out:
                if r.weight_version != expected_version:
                    raise WeightVersionMismatch(f"engine {self.name} answered {what} under version "
                                                f"{r.weight_version}, caller expects {expected_version}")
        return out

    def generate(self, requests: list[GenerateRequest], sampling: SamplingSettings,
                 weight_version: int) -> list[GenerateResult]:
        out = self.wait(self.submit("generate", requests, sampling, weight_version), "generate", weight_version)
        check_count(self.name, "generate", out, len(requests))
        return out

    def score(self, requests: list[ScoreRequest], sampling: SamplingSettings,
              weight_version: int) -> list[ScoreResult]:
        out = self.wait(self.submit("score", requests, sampling, weight_version), "score", weight_version)
        check_count(self.name, "score", out, len(requests))
        return out

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Direct load (tests, tools); a run's syncs go through resync.routes instead."""
        self._get(self.submit("update_weights", list(named_tensors), version), self.timeout_s, "update_weights")

    def finish_update(self, version: int) -> None:
        self._get(self.submit("finish_update", version), self.timeout_s, "finish_update")

    def submit_actor(self, method: str, *args):
        """Start an EngineActor method without waiting (`__ray_call__`: a function run in the actor)."""
        return getattr(self._running_actor(), method).remote(*args)

    def reset_prefix_cache(self) -> None:
        self._get(self.submit("reset_prefix_cache"), self.timeout_s, "reset_prefix_cache")

    def release_memory(self) -> None:
        self._get(self.submit("release_memory"), self.timeout_s, "release_memory")

    def resume_memory(self, tags: list[str] | None = None) -> None:
        self._get(self.submit("resume_memory", tags), self.timeout_s, "resume_memory")

    def _drafts(self) -> bool:
        return issubclass(self.engine_cls, DraftsFromTrees)

    @property
    def tree_drafting(self) -> bool:
        """The engine's class drafts from trees and was asked to (its `draft` argument)."""
        return self._drafts() and self.engine_kwargs.get("draft") == "tree"

    def draft_stats(self) -> dict[str, float]:
        return self._get(self.submit("draft_stats"), self.timeout_s, "draft_stats") if self._drafts() else {}

    def draft_state(self) -> dict | None:
        return self._get(self.submit("draft_state"), self.timeout_s, "draft_state") if self._drafts() else None

    def add_to_draft_trees(self, responses: list[DraftResponse]) -> None:
        # an engine without tree drafting ignores them: not worth a round trip with the step's tokens
        if responses and self.tree_drafting:
            self._get(self.submit("add_to_draft_trees", responses), self.timeout_s, "add_to_draft_trees")

    def load_draft_state(self, state: dict) -> None:
        if not self._drafts():
            raise ValueError(f"engine {self.name} ({self.engine_cls.__name__}) does not draft from trees")
        self._get(self.submit("load_draft_state", state), self.timeout_s, "load_draft_state")

    def run_in_workers(self, fn, kwargs: dict | None = None) -> list:
        """fn(worker, **kwargs) in each of the engine's workers, in its actor."""
        if not issubclass(self.engine_cls, RunsInWorkers):
            raise NotImplementedError(f"engine {self.name} ({self.engine_cls.__name__}) runs nothing in workers")
        return self.wait(self.submit("run_in_workers", fn, kwargs), "run_in_workers")

    def health(self) -> EngineHealth:
        try:
            h = self._get(self.submit("health"), min(self.timeout_s, 30.0), "health")
        except EngineError as e:
            return EngineHealth(alive=False, weight_version=-1,
                                detail={"name": self.name, "error": str(e).splitlines()[0]})
        h.detail.setdefault("pid", self._pid)
        return h

    def last_log_lines(self, n: int = 50) -> list[str]:
        return tail_lines(self.log_path, n)

    # -- error conversion ---------------------------------------------------------
    def _get(self, ref, timeout: float, what: str, deadline: float | None = None) -> Any:
        """`timeout` is what a timeout reports; `deadline`, if given, when it runs out."""
        import ray
        from ray.exceptions import GetTimeoutError, OutOfMemoryError, RayActorError, RayTaskError

        try:
            return ray.get(ref, timeout=timeout if deadline is None else max(0.0, deadline - time.monotonic()))
        except RayTaskError as e:
            # raised by the engine in the actor: Ray's wrapper reads `ray::EngineActor.call() (pid=...)`
            # on its first line, the line a restart logs and the user reads; the engine's own error
            # already names the engine and the problem (the Ray traceback stays chained)
            if isinstance(e.cause, (EngineError, WeightVersionMismatch)):
                raise e.cause from e
            raise
        except GetTimeoutError as e:
            raise EngineError(f"{what} timed out after {timeout:.0f}s", self.name, self.last_log_lines()) from e
        except OutOfMemoryError as e:
            raise EngineError(f"{what}: engine killed for out of memory: {e}", self.name,
                              self.last_log_lines()) from e
        except RayActorError as e:
            pid = f" (pid {self._pid})" if self._pid is not None else ""   # None: it died while starting
            raise EngineError(f"{what}: engine process died{pid}: {death_cause(e)}", self.name,
                              self.last_log_lines()) from e


def wait_engines(calls: list[tuple[RayEngine, Any]], what: str, expected_version: int | None = None) -> list:
    """[(engine, ref)] of calls already submitted to several engines -> their results, in that order.

    Waiting on each in turn reported engine 1's death (or error) only once engine 0 had finished its
    minutes-long batch. Here the first failure is raised as soon as it arrives, translated by its own
    engine's `wait`; each engine's timeout_s counts from now, as when it is waited on alone. The other
    calls are left running: a failure ends in a restart of every engine (run.recovery), which
    kills them, and an actor that was not restarted runs the next call after them (one at a time)."""
    import ray

    start = time.monotonic()
    deadline = {ref: start + e.timeout_s for e, ref in calls}
    pending = {ref: i for i, (_, ref) in enumerate(calls)}
    out: list = [None] * len(calls)
    while pending:
        soonest = min(pending, key=deadline.__getitem__)
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline[soonest] - time.monotonic()))
        ref = ready[0] if ready else soonest       # none answered in time: its wait raises its timeout
        i = pending.pop(ref)
        out[i] = calls[i][0].wait(ref, what, expected_version, deadline=deadline[ref])
    return out


_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*(?:Error|Exception)): (.+)$")
_DEAD_BECAUSE = "The actor is dead because "
# Ray's advice appended to a worker's death (OOM killer, `ray stop --force`, SIGSEGV), not its cause
_RAY_ADVICE = re.compile(r"\s+(?:Some common causes include|There are some potential root causes)\b.*$")


def death_cause(e: BaseException) -> str:
    """One line for why an engine actor died. Ray's first line says only that the actor died; when it
    died in its creation task (the engine failed to start: bad settings, too few CPUs, vLLM refusing
    the model) the traceback Ray appends ends in the exception that says why: that line."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    if "creation task" in lines[0]:
        for ln in reversed(lines):
            m = _EXCEPTION_LINE.match(ln)
            if m:
                return f"its start raised {m[1]}: {m[2]}"
    # a death while running (SIGKILL, OOM killer, ray.kill, node lost): Ray's first line is only
    # "The actor died unexpectedly before finishing this task."; the line after its actor fields says why
    for ln in lines[1:]:
        if ln.startswith(_DEAD_BECAUSE):
            return f"{lines[0]} {_RAY_ADVICE.sub('', ln)}"
    return lines[0]
