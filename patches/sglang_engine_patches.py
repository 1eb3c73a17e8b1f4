"""The SGLang patches this project's engines run with, applied only in processes our engines start.

`SGLangEngine(draft="tree")` and SGLangEngine on CPU set SPECRL_SGLANG_PATCHES=1 (and the tree
settings, or SGLang's CPU switch) in its environment before `sglang.Engine` starts its scheduler
processes, which inherit it and run `plugin()` through SGLang's `sglang.srt.plugins` entry point
(`load_plugins()` at the start of every scheduler process). Any other SGLang process in the same
environment finds the variable unset: installing the project changes nothing there. A server started
by hand (SGLangHTTPEngine) needs the same variables (`engines/sglang/server.py`, `tree_server_env`).
Each patch has its own gate besides: the tree proposer its settings variable, seeded sampling the CPU.
"""

from __future__ import annotations

import os

ENV = "SPECRL_SGLANG_PATCHES"


def apply_all() -> dict[str, bool]:
    """Apply every patch (each pinned to its SGLang version, gated and idempotent); name -> applied."""
    from megatron_specrl.patches import sglang_0_5_23_seeded_sampling, sglang_0_5_23_tree_proposer
    return {"tree_proposer": sglang_0_5_23_tree_proposer.apply(),
            "seeded_sampling": sglang_0_5_23_seeded_sampling.apply()}


def plugin() -> None:
    """SGLang's general-plugin hook, run in every SGLang process of this environment."""
    if os.environ.get(ENV) == "1":
        apply_all()
