"""An engine actor that dies while it starts names the reason in the one line the user reads (Ray's
own first line says only that the actor died in its creation task)."""

import pytest

from megatron_specrl.engines.ray_engine import death_cause

CREATION = ("The actor died because of an error raised in its creation task, \x1b[36mray::EngineActor.__init__()"
            "\x1b[39m (pid=29384, ip=192.0.2.2, actor_id=ea34, repr=<EngineActor object at 0x7f>)\n"
            "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
            '  File "/work/main/megatron_specrl/engines/vllm_engine.py", line 160, in bind_cpu_workers\n'
            "    raise ValueError(f\"engine tensor_parallel_size={n} needs a CPU per worker; \"\n{}")


@pytest.mark.parametrize("tail, expected", [
    ("ValueError: engine tensor_parallel_size=4 needs a CPU per worker; this process may use 2",
     "its start raised ValueError: engine tensor_parallel_size=4 needs a CPU per worker; this process may use 2"),
    ("megatron_specrl.engines.protocol.EngineError: [vllm-0] vLLM failed to start: RuntimeError('no KV room')\n"
     "--- last engine log lines ---\n2026-11-24 12:38:05,172 INFO starting vLLM engine",
     "its start raised EngineError: [vllm-0] vLLM failed to start: RuntimeError('no KV room')"),
])
def test_a_start_failure_names_the_exception(tail, expected):
    assert death_cause(RuntimeError(CREATION.replace("{}", tail))) == expected


def test_other_deaths_keep_rays_first_line():
    assert death_cause(RuntimeError("The actor died unexpectedly before finishing this task.\n  more")) == \
        "The actor died unexpectedly before finishing this task."
    assert death_cause(RuntimeError("")) == "RuntimeError"
    # a creation-task death whose traceback ends in no exception line: Ray's line, not a guess
    assert death_cause(RuntimeError("The actor died because of an error raised in its creation task, x\n  ^^^")) == \
        "The actor died because of an error raised in its creation task, x"
