"""Import boundaries between concerns (issue #14).

- Concerns keep their side of the line (tests/import_graph.py reads the imports with ast): the
  speculative core needs no engine, Ray or Megatron, engines never see learner code, the learner
  reaches neither an engine nor resync, and no import cycles; a planted tree proves the checker bites.
- Engines stand alone: the SGLang and Ray engine modules import in a process where vLLM cannot
  be imported at all, and without loading the vLLM engine's module, so an SGLang-only install
  works and a vLLM upgrade cannot break them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

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
    proc = _import_without_vllm("megatron_specrl.engines.sglang_engine", "megatron_specrl.engines.ray_engine",
                                "megatron_specrl.engines.router", "megatron_specrl.engines.factory",
                                "megatron_specrl.engines.logs", "!megatron_specrl.engines.vllm_engine")
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


def test_the_vllm_block_is_real():
    """The finder must actually stop vLLM, or the test above proves nothing."""
    proc = _import_without_vllm("megatron_specrl.engines.vllm_engine", "vllm")
    assert proc.returncode != 0 and "vllm is blocked" in proc.stderr, proc.stdout + proc.stderr


# ----------------------------------------------------------------------------- concern boundaries
def test_package_respects_the_boundaries_and_has_no_cycles():
    """The speculative core needs no engine, Ray or Megatron; engines never see the learner; the
    learner reaches neither an engine nor resync (resync/ drives it from actors.py); no cycles."""
    from import_graph import cycles, violations
    pkg = ROOT / "megatron_specrl"
    assert violations(pkg) == []
    assert cycles(pkg) == []


def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    pkg = tmp_path / "megatron_specrl"
    for rel, text in files.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in [path.parent, *path.parent.parents]:
            if parent == tmp_path:
                break
            (parent / "__init__.py").touch()
        path.write_text(text)
    return pkg


def test_checker_catches_planted_violations(tmp_path):
    from import_graph import cycles, violations
    pkg = _plant(tmp_path, {
        "rollout/acceptance.py": "def f():\n    import vllm   # late, still a dependency\n",
        "rollout/speculative.py": "from megatron_specrl.engines.protocol import X\n"      # allowed
                                  "from ..engines import vllm_engine\n",                  # relative, not
        "rollout/store.py": "import ray.util\n",
        "rollout/draft_tree.py": "from megatron.core import parallel_state\n",
        "engines/protocol.py": "",
        "engines/vllm_engine.py": "from megatron_specrl.learner.worker import LearnerWorker\n",
        "engines/ray_engine.py": "def f():\n    from megatron_specrl.resync.transports import T\n",
        "learner/worker.py": "from megatron_specrl.resync import buckets\n",
        "learner/group.py": "import megatron_specrl.engines.vllm_engine\n",
        "resync/buckets.py": "",
        "a.py": "from megatron_specrl import b, c\n",
        "b.py": "def f():\n    from megatron_specrl.a import g\n",
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from megatron_specrl import a\n",
    })
    found = violations(pkg)
    assert [v.split(":")[0] for v in found] == [
        "megatron_specrl.engines.ray_engine imports megatron_specrl.resync.transports",
        "megatron_specrl.engines.vllm_engine imports megatron_specrl.learner.worker",
        "megatron_specrl.learner.group imports megatron_specrl.engines.vllm_engine",
        "megatron_specrl.learner.worker imports megatron_specrl.resync",
        "megatron_specrl.rollout.acceptance imports vllm",
        "megatron_specrl.rollout.draft_tree imports megatron.core",
        "megatron_specrl.rollout.speculative imports megatron_specrl.engines",
        "megatron_specrl.rollout.store imports ray.util",
    ], found
    # the late a <-> b import is a cycle; c -> a is for annotations only, so c is not in it
    assert cycles(pkg) == [["megatron_specrl.a", "megatron_specrl.b"]]
