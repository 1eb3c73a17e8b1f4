"""The vLLM patches this project's engines run with, applied only in processes our engines start.

`VLLMEngine` calls `apply_all()` in its own process and sets SPECRL_VLLM_PATCHES=1 before it
builds the LLM, so vLLM's multiprocess workers (which inherit the environment) apply them too
through the `vllm.general_plugins` entry point `plugin()`. Any other vLLM process in the same
environment loads the entry point and finds the variable unset: installing the project changes
nothing there.
"""

from __future__ import annotations

import os

ENV = "SPECRL_VLLM_PATCHES"


def apply_all() -> dict[str, bool]:
    """Apply every patch (each is pinned to its vLLM version and idempotent); name -> applied."""
    from megatron_specrl.patches import (
        vllm_0_32_0_batched_prompt_logprobs, vllm_0_32_0_coupled_sampling, vllm_0_32_0_cpu_kernel_scan,
        vllm_0_32_0_cpu_spec_decode, vllm_0_32_0_tree_proposer,
    )
    return {"batched_prompt_logprobs": vllm_0_32_0_batched_prompt_logprobs.apply(),
            "coupled_sampling": vllm_0_32_0_coupled_sampling.apply(),
            "tree_proposer": vllm_0_32_0_tree_proposer.apply(),
            "cpu_spec_decode": vllm_0_32_0_cpu_spec_decode.apply(),
            "cpu_kernel_scan": vllm_0_32_0_cpu_kernel_scan.apply()}


def mark_our_engine() -> None:
    """Called by our engine before vLLM starts workers: they apply the patches too."""
    os.environ[ENV] = "1"


def plugin() -> None:
    """vLLM's general-plugin hook, run in every vLLM process of this environment."""
    if os.environ.get(ENV) == "1":
        apply_all()
