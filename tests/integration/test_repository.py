"""Undefined names, stale imports and unused variables fail the suite (pyflakes rules via ruff).

The tests of this subject that start processes or engines; the rest are in tests/unit/test_repository.py.
"""

from __future__ import annotations
import shutil
import subprocess
import sys
from pathlib import Path


from tests.helpers.paths import REPO_ROOT as ROOT

def test_no_pyflakes_errors():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    proc = subprocess.run([ruff, "check", "--select", "F", "--output-format", "concise",
                           "megatron_specrl", "benchmarks", "tests", "patches"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# A meta-path finder placed first: any `import vllm` (or a submodule) raises ImportError, as on a
# machine without vLLM. Then each module is imported and vllm must still be absent.
_WITHOUT_VLLM = """
import importlib, sys

class NoVllm:
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError(f"vllm is blocked in this test ({name})")
        return None

sys.meta_path.insert(0, NoVllm())
modules = [m for m in sys.argv[1:] if not m.startswith("!")]
forbidden = ["vllm"] + [m[1:] for m in sys.argv[1:] if m.startswith("!")]
for m in modules:
    importlib.import_module(m)
loaded = sorted(k for k in sys.modules if any(k == f or k.startswith(f + ".") for f in forbidden))
assert not loaded, f"imported: {loaded}"
print("ok")
"""


def _import_without_vllm(*modules: str) -> subprocess.CompletedProcess:
    """Import `modules` with vLLM blocked; a name written "!x" must not get imported either."""
    return subprocess.run([sys.executable, "-c", _WITHOUT_VLLM, *modules], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_sglang_and_ray_engines_import_without_vllm():
    proc = _import_without_vllm("megatron_specrl.engines.sglang", "megatron_specrl.engines.ray_engine",
                                "megatron_specrl.engines.router", "megatron_specrl.engines.factory",
                                "megatron_specrl.engines.logs", "!megatron_specrl.engines.vllm")
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


def test_the_vllm_block_is_real():
    """The finder must actually stop vLLM, or the test above proves nothing."""
    proc = _import_without_vllm("megatron_specrl.engines.vllm", "vllm")
    assert proc.returncode != 0 and "vllm is blocked" in proc.stderr, proc.stdout + proc.stderr


