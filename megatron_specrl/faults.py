"""Fault injection for crash/resume tests, as a hook the training loop calls before each phase.

SPECRL_KILL_AT="phase:step" SIGKILLs the driver there; SPECRL_KILL_ENGINE_AT="step" SIGKILLs the
first engine's process just before that step's rollout, "phase:step" before that phase of the step.
Phases: rollout, train, resync, checkpoint, and refresh: inside the exact overlap's refresh
(trainer.overlap=exact), once the engines have verified and re-decoded the batch (the trajectory store
and the draft trees hold the refreshed responses) and before it is scored again, so a kill there finds
the refresh's side effects half done, the hardest point for a resume.
A real SIGKILL (no cleanup, no atexit) is what a preempted Slurm node or an OOM kill does, so
resume is tested against that.

The production step knows nothing of this: `train` passes a PhaseHooks to the loop, the no-op
one unless one of the variables is set (`from_env`).
"""

from __future__ import annotations

import os
import signal
from typing import Callable

ENV = "SPECRL_KILL_AT"
ENGINE_ENV = "SPECRL_KILL_ENGINE_AT"
PHASES = ("rollout", "refresh", "train", "resync", "checkpoint")


class PhaseHooks:
    """The loop's hook point: `before(phase, step)` runs just before each phase of a step."""

    def before(self, phase: str, step: int) -> None:
        pass


class KillAt(PhaseHooks):
    """SIGKILL this process at (phase, step), and/or the first engine before (engine_phase, engine_step)."""

    def __init__(self, phase: str | None = None, step: int | None = None, engine_step: int | None = None,
                 engines: Callable[[], list] = list, engine_phase: str = "rollout"):
        for var, p in ((ENV, phase), (ENGINE_ENV, engine_phase)):
            if p is not None and p not in PHASES:
                raise ValueError(f"{var}: unknown phase {p!r}; expected one of {PHASES}")
        self.phase, self.step, self.engine_step, self.engines = phase, step, engine_step, engines
        self.engine_phase = engine_phase

    def before(self, phase: str, step: int) -> None:
        if (phase, step) == (self.engine_phase, self.engine_step):
            engines = self.engines()
            if engines and engines[0].pid:   # Ray engine handles (protocol.InActor); None: not started
                os.kill(engines[0].pid, signal.SIGKILL)
        if (phase, step) == (self.phase, self.step):
            os.kill(os.getpid(), signal.SIGKILL)


def from_env(engines: Callable[[], list] = list, environ=os.environ) -> PhaseHooks:
    """KillAt from SPECRL_KILL_AT / SPECRL_KILL_ENGINE_AT, or the no-op hooks when neither is set.
    `engines`: the engine handles (with .pid) at the time of the kill, after any restart."""
    spec, engine_spec = environ.get(ENV, ""), environ.get(ENGINE_ENV, "")
    phase, _, step = spec.partition(":")
    # a typo must not turn a crash test into a run that never crashes (and so passes)
    if spec and not step.isdigit():
        raise ValueError(f"{ENV}={spec!r}: expected phase:step, e.g. train:3")
    engine_phase, _, engine_step = engine_spec.rpartition(":")
    if engine_spec and (not engine_step.isdigit() or (":" in engine_spec and not engine_phase)):   # ":2" too
        raise ValueError(f"{ENGINE_ENV}={engine_spec!r}: expected a step number or phase:step, e.g. 2 or resync:2")
    kill_self, kill_engine = bool(spec), bool(engine_spec)
    if not (kill_self or kill_engine):
        return PhaseHooks()
    return KillAt(phase if kill_self else None, int(step) if kill_self else None,
                  int(engine_step) if kill_engine else None, engines, engine_phase or "rollout")
