"""Fault injection for crash/resume tests: SPECRL_KILL_AT="phase:step" SIGKILLs the driver there;
SPECRL_KILL_ENGINE_AT="step" SIGKILLs the first engine's process just before that step's rollout.

Phases: rollout, train, resync, checkpoint. A real SIGKILL (no cleanup, no atexit) is
what a preempted Slurm node or an OOM kill does, so resume is tested against that.
"""

from __future__ import annotations

import os
import signal

ENV = "SPECRL_KILL_AT"
ENGINE_ENV = "SPECRL_KILL_ENGINE_AT"


def maybe_kill(phase: str, step: int) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    want_phase, _, want_step = spec.partition(":")
    if want_phase == phase and want_step.isdigit() and int(want_step) == step:
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_kill_engine(engines: list, step: int) -> None:
    spec = os.environ.get(ENGINE_ENV)
    if spec and spec.isdigit() and int(spec) == step and getattr(engines[0], "pid", None):
        os.kill(engines[0].pid, signal.SIGKILL)
