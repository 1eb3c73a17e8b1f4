"""Loading a benchmarks/ script as a module, and reading the rows it writes."""

from __future__ import annotations

import importlib.util

from tests.helpers.paths import REPO_ROOT

TOOLS = REPO_ROOT / "benchmarks"


def _tool(name):
    spec = importlib.util.spec_from_file_location(f"benchmark_tool_{name}", TOOLS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows(step, responses, finish="length", prompt_id="p"):
    return [{"step": step, "prompt_id": prompt_id, "sample_idx": k, "prompt_ids": [100, 101], "response_ids": r,
             "finish_reason": finish} for k, r in enumerate(responses)]


