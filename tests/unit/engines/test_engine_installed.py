"""A run whose rollout engine is not installed stops before Ray starts, in one line naming it.

Before, `train ... rollout.engine=sglang` without SGLang started Ray and the learner and failed ~10 s
later, when the engine actor's start raised ModuleNotFoundError; `--dry-run` passed.
"""

from __future__ import annotations
import importlib.util
import pytest
from megatron_specrl.cli import main
from megatron_specrl.config import ConfigError
from megatron_specrl.run.build import check_engine_installed

RECIPE = "examples/tiny-cpu-grpo.yaml"


@pytest.fixture
def sglang_missing(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.delitem(__import__("sys").modules, "sglang", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a))


def test_a_missing_engine_package_is_named(sglang_missing):
    check_engine_installed("vllm")      # installed with the project's CPU extras
    with pytest.raises(ConfigError, match=r"rollout.engine='sglang': the sglang package is not installed"):
        check_engine_installed("sglang")


def test_dry_run_and_train_stop_before_anything_starts(sglang_missing, tmp_path, capsys):
    out = tmp_path / "run"
    for extra in (["--dry-run"], []):
        # draft=none: the recipe's tree drafting with SGLang is a GPU setting, which the plan refuses on CPU
        assert main(["train", RECIPE, f"output_dir={out}", "rollout.engine=sglang", "rollout.draft=none", *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == ["megatron-specrl: config error: rollout.engine='sglang': the sglang package is not "
                       "installed in this environment (the default engine is vllm)"]
        assert not out.exists()          # nothing written, no Ray started


def test_check_resync_with_a_missing_engine_stops_before_ray(sglang_missing, capsys, monkeypatch):
    """check-resync --engine sglang without SGLang: the same one line, before Ray and the learner start."""
    import megatron_specrl.diagnostics.check as check
    monkeypatch.setattr(check, "check_resync_main", lambda argv: pytest.fail("started the check"))
    assert main(["check-resync", "--engine", "sglang"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "megatron-specrl: config error: rollout.engine='sglang': the sglang package is not installed in this "
        "environment (the default engine is vllm)"]
