"""The vLLM patches an engine's features need are checked when it starts (engines/vllm/required_patches.py):
a feature whose patch is pinned to another vLLM release is refused before vLLM is built, with one line that
names the patch and the installed version, instead of at the feature's first use. No engine starts here:
the installed version is replaced."""

from __future__ import annotations

import pytest

from megatron_specrl.engines.vllm import required_patches as rp
from megatron_specrl.patches import (
    vllm_0_32_0_batched_prompt_logprobs, vllm_0_32_0_coupled_sampling, vllm_0_32_0_cpu_kernel_scan,
    vllm_0_32_0_cpu_spec_decode, vllm_0_32_0_tree_proposer,
)


def test_each_feature_names_the_patches_it_needs():
    assert rp.required_patches(draft="none", verification=False, coupled_sampling=False, on_cpu=False) == {}
    assert set(rp.required_patches(draft="none", verification=True, coupled_sampling=False, on_cpu=False)) == {
        vllm_0_32_0_batched_prompt_logprobs}
    assert set(rp.required_patches(draft="none", verification=False, coupled_sampling=True, on_cpu=False)) == {
        vllm_0_32_0_batched_prompt_logprobs, vllm_0_32_0_coupled_sampling}
    assert set(rp.required_patches(draft="tree", verification=False, coupled_sampling=False, on_cpu=False)) == {
        vllm_0_32_0_tree_proposer}
    assert set(rp.required_patches(draft="model", verification=False, coupled_sampling=False, on_cpu=False)) == set()
    assert set(rp.required_patches(draft="none", verification=False, coupled_sampling=False, on_cpu=True)) == {
        vllm_0_32_0_cpu_kernel_scan}
    assert set(rp.required_patches(draft="model", verification=False, coupled_sampling=False, on_cpu=True)) == {
        vllm_0_32_0_cpu_kernel_scan, vllm_0_32_0_cpu_spec_decode}


@pytest.mark.parametrize("features, patch", [
    (dict(draft="none", verification=True, coupled_sampling=False), "vllm_0_32_0_batched_prompt_logprobs"),
    (dict(draft="tree", verification=False, coupled_sampling=False), "vllm_0_32_0_tree_proposer"),
    (dict(draft="none", verification=False, coupled_sampling=True), "vllm_0_32_0_batched_prompt_logprobs"),
])
def test_a_patch_pinned_to_another_release_is_refused_in_one_line(monkeypatch, features, patch):
    monkeypatch.setattr(rp, "installed_vllm_version", lambda: "0.99.0")
    with pytest.raises(rp.PatchNotApplicable) as e:
        rp.check_pinned_to_installed(rp.required_patches(on_cpu=False, **features))
    message = str(e.value)
    assert f"patches/{patch}.py" in message and "0.99.0" in message and "0.32.0" in message, message
    assert "\n" not in message


def test_the_coupled_patch_is_named_when_it_is_the_one_that_does_not_apply(monkeypatch):
    needed = {vllm_0_32_0_coupled_sampling: "coupled sampling (rollout.spec_mode=coupled)"}
    monkeypatch.setattr(rp, "installed_vllm_version", lambda: "0.33.1")
    with pytest.raises(rp.PatchNotApplicable, match=r"coupled sampling \(rollout.spec_mode=coupled\) needs "
                                                    r"patches/vllm_0_32_0_coupled_sampling.py, .*vllm is 0.33.1"):
        rp.check_pinned_to_installed(needed)


def test_the_pinned_release_passes_and_a_patch_switched_off_is_refused_after_applying(monkeypatch):
    needed = rp.required_patches(draft="tree", verification=True, coupled_sampling=True, on_cpu=True)
    monkeypatch.setattr(rp, "installed_vllm_version", lambda: "0.32.0")
    rp.check_pinned_to_installed(needed)                          # every patch is pinned to 0.32.0
    monkeypatch.setattr(vllm_0_32_0_batched_prompt_logprobs, "is_applied", lambda: False)
    for patch in needed:
        if patch is not vllm_0_32_0_batched_prompt_logprobs:
            monkeypatch.setattr(patch, "is_applied", lambda: True)
    with pytest.raises(rp.PatchNotApplicable, match=r"verification \(score\(\)\) needs "
                                                    r"patches/vllm_0_32_0_batched_prompt_logprobs.py, which did "
                                                    r"not apply to vllm 0.32.0"):
        rp.check_applied(needed)


@pytest.mark.parametrize("settings, uses", [
    (dict(spec_mode="exact"), dict(verification=True, coupled_sampling=False)),
    (dict(spec_mode="coupled"), dict(verification=True, coupled_sampling=True)),
    (dict(spec_mode="off"), dict(verification=False, coupled_sampling=False)),
    (dict(spec_mode="exact", draft="tree"), dict(verification=False, coupled_sampling=False)),   # verify=decode
    (dict(spec_mode="exact", draft="tree", verify="prefill"), dict(verification=True, coupled_sampling=False)),
])
def test_the_factory_tells_the_engine_which_features_the_rollout_uses(tmp_path, settings, uses):
    from megatron_specrl.config import RolloutConfig
    from megatron_specrl.engines.factory import engine_kwargs

    _, kwargs = engine_kwargs(RolloutConfig(**settings).resolved(), str(tmp_path), tmp_path, 0, 0)
    assert {k: kwargs[k] for k in uses} == uses
