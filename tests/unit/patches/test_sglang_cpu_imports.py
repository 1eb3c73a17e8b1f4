"""patches/sglang_0_5_23_cpu_imports.py: the import-time stand-ins SGLang's CPU processes get (sgl_kernel,
torchvision), pinned to sglang 0.5.23, gated on SGLANG_USE_CPU_ENGINE=1, reverted by uninstall()."""

import importlib
import os
import sys
from pathlib import Path

import pytest

from megatron_specrl.patches import sglang_0_5_23_cpu_imports as cpu_imports

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def stand_ins(monkeypatch):
    monkeypatch.setattr(cpu_imports, "installed_sglang_version", lambda: cpu_imports.SGLANG_VERSION)
    monkeypatch.setattr(cpu_imports, "_real", lambda name: False)
    assert cpu_imports.install() and cpu_imports.active()
    yield
    cpu_imports.uninstall()


def test_sgl_kernel_names_import_and_refuse_calls_while_its_submodules_stay_missing(stand_ins):
    from sgl_kernel import copy_all_layer_kv_cache_cpu   # an `if _is_cpu:` import at SGLang's module level
    with pytest.raises(RuntimeError, match="copy_all_layer_kv_cache_cpu.*stand-in"):
        copy_all_layer_kv_cache_cpu()
    with pytest.raises(ImportError):                     # SGLang's `except ImportError` fallbacks run
        importlib.import_module("sgl_kernel.speculative")


def test_torchvision_imports_any_submodule_and_refuses_calls(stand_ins):
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.v2 import functional as tvF

    class Sub(InterpolationMode):   # a class body over a stand-in base
        x = InterpolationMode.BICUBIC
    with pytest.raises(RuntimeError, match="torchvision.transforms.v2.functional.resize"):
        tvF.resize(None)
    assert Sub.x is not None


def test_uninstall_reverts_and_other_sglang_releases_are_left_alone(monkeypatch, stand_ins):
    cpu_imports.uninstall()
    assert not cpu_imports.active() and "sgl_kernel" not in sys.modules
    monkeypatch.setattr(cpu_imports, "installed_sglang_version", lambda: "0.5.24")
    assert not cpu_imports.install() and not cpu_imports.active()


def test_pth_line_acts_only_in_sglang_cpu_processes(monkeypatch):
    monkeypatch.delenv(cpu_imports.ENV, raising=False)
    assert cpu_imports.PTH_LINE.startswith("import ")   # site runs only such .pth lines
    exec(cpu_imports.PTH_LINE, {})
    assert not cpu_imports.active()
    monkeypatch.setenv(cpu_imports.ENV, "1")
    monkeypatch.setattr(cpu_imports, "installed_sglang_version", lambda: cpu_imports.SGLANG_VERSION)
    monkeypatch.setattr(cpu_imports, "_real", lambda name: False)
    try:
        exec(cpu_imports.PTH_LINE, {})
        assert cpu_imports.active()
    finally:
        cpu_imports.uninstall()
    assert os.environ[cpu_imports.ENV] == "1"


def test_cpu_install_pins_the_release_the_stand_ins_target():
    setup_env = (ROOT / "tools" / "setup_env.sh").read_text()
    assert f"sglang=={cpu_imports.SGLANG_VERSION}" in setup_env
    assert "megatron_specrl.patches.sglang_0_5_23_cpu_imports" in setup_env
    assert f'"sglang=={cpu_imports.SGLANG_VERSION}"' in (ROOT / "setup.py").read_text()
