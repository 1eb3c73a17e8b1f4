"""What the unit tier may not do: start a process, a Ray cluster or an inference engine.

tests/unit/conftest.py installs `guard` around every unit test: a test that starts a subprocess,
a multiprocessing process (spawned ranks), `ray.init` or a vLLM `LLM` fails with the call it made,
so a test that needs one of them cannot drift into the fast tier. The same hooks, with `record`,
list what each test of any tier starts (`SPECRL_TEST_RECORD=<file>`), which is how the tiers were
sorted.
"""

from __future__ import annotations

import multiprocessing.process
import subprocess
import sys
from contextlib import contextmanager


class TierViolation(AssertionError):
    """A unit test started something only integration and end-to-end tests may start."""


def _hooks(on_call):
    """(owner, attribute, what) triples to wrap; third-party ones only where already imported."""
    hooks = [(subprocess.Popen, "__init__", "a subprocess"),
             (multiprocessing.process.BaseProcess, "start", "a multiprocessing process (spawned ranks)")]
    ray = sys.modules.get("ray")
    if ray is not None and hasattr(ray, "init"):
        hooks.append((ray, "init", "ray.init"))
    ours = sys.modules.get("megatron_specrl.engines.vllm.engine")
    if ours is not None:
        hooks.append((ours.VLLMEngine, "__init__", "a vLLM engine (VLLMEngine)"))
    vllm = sys.modules.get("vllm")
    if vllm is not None and "LLM" in getattr(vllm, "__dict__", {}):
        hooks.append((vllm.LLM, "__init__", "a vLLM engine"))
    return hooks


@contextmanager
def intercept(on_call):
    """Call `on_call(what)` before each guarded call; restore everything after."""
    saved = []
    for owner, attr, what in _hooks(on_call):
        original = getattr(owner, attr)

        def wrapper(*args, __original=original, __what=what, **kwargs):
            on_call(__what)
            return __original(*args, **kwargs)

        saved.append((owner, attr, original))
        setattr(owner, attr, wrapper)
    try:
        yield
    finally:
        for owner, attr, original in reversed(saved):
            setattr(owner, attr, original)


def refuse(what: str) -> None:
    raise TierViolation(f"a unit test started {what}: move it to tests/integration/ or tests/e2e/")
