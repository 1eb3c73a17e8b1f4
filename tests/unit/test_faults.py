"""Fault injection is a hook the loop calls, off unless its variables are set.
"""

from types import SimpleNamespace
import pytest
from megatron_specrl import faults

def test_no_variables_means_the_no_op_hooks():
    hooks = faults.from_env(environ={})
    assert type(hooks) is faults.PhaseHooks
    hooks.before("rollout", 1)   # does nothing


def test_kill_at_phase_and_step_and_engine_before_its_rollout(monkeypatch):
    killed = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: killed.append(pid))
    engines = [SimpleNamespace(pid=4242)]
    hooks = faults.from_env(lambda: engines, {faults.ENV: "train:3", faults.ENGINE_ENV: "2"})
    for step in (1, 2, 3):
        for phase in faults.PHASES:
            hooks.before(phase, step)
    assert killed == [4242, faults.os.getpid()]      # the engine at step 2's rollout, the driver at 3's train


def test_unknown_phase_fails_loudly():
    with pytest.raises(ValueError, match="unknown phase"):
        faults.from_env(environ={faults.ENV: "trian:3"})


def test_engine_kill_before_another_phase(monkeypatch):
    killed = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: killed.append((pid, phase, step)))
    hooks = faults.from_env(lambda: [SimpleNamespace(pid=4242)], {faults.ENGINE_ENV: "resync:2"})
    for step in (1, 2, 3):
        for phase in faults.PHASES:
            hooks.before(phase, step)
    assert killed == [(4242, "resync", 2)]
    with pytest.raises(ValueError, match="unknown phase"):
        faults.from_env(environ={faults.ENGINE_ENV: "resycn:2"})
    with pytest.raises(ValueError, match="phase:step"):
        faults.from_env(environ={faults.ENGINE_ENV: "resync:"})


def test_an_empty_engine_phase_is_a_typo_not_the_rollout():
    """`:2` (a phase left out) was read as rollout:2: a crash test could kill at a phase it never named."""
    with pytest.raises(ValueError, match="phase:step"):
        faults.from_env(environ={faults.ENGINE_ENV: ":2"})
    assert faults.from_env(environ={faults.ENGINE_ENV: "2"}).engine_phase == "rollout"
