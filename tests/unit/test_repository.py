"""The repository's own rules: no session numbers, test files in tiers, the unit tier's guard, and the
import boundaries between concerns (issue #14).

- Concerns keep their side of the line (tests/helpers/import_graph.py reads the imports with ast): the
  speculative core needs no engine, Ray or Megatron, engines never see learner code, the learner
  reaches neither an engine nor resync, and no import cycles; a planted tree proves the checker bites.
- Engines stand alone: the SGLang and Ray engine modules import in a process where vLLM cannot
  be imported at all, and without loading the vLLM engine's module, so an SGLang-only install
  works and a vLLM upgrade cannot break them.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers.paths import REPO_ROOT



ROOT = REPO_ROOT




SKIP_DIRS = {".git", ".venv", "outputs", "wandb", "build", "dist", ".cache", "__pycache__", ".pytest_cache"}
SESSION = re.compile(r"\bsessions? [0-9]+", re.IGNORECASE)


def _repository_text_files():
    for path in REPO_ROOT.rglob("*"):
        rel = path.relative_to(REPO_ROOT)
        if any(part in SKIP_DIRS or part.endswith(".egg-info") for part in rel.parts) or not path.is_file():
            continue
        try:
            yield rel, path.read_text()
        except (UnicodeDecodeError, OSError):
            continue            # binary files


def test_nothing_in_the_repository_speaks_of_sessions():
    """Code, comments, tests, docs and settings name a date, a commit or a machine, never a session number."""
    hits = [f"{rel}:{n}" for rel, text in _repository_text_files()
            for n, line in enumerate(text.splitlines(), 1) if SESSION.search(line)]
    assert hits == []


def test_test_files_sit_in_a_tier_and_are_named_by_behaviour():
    """Every test file is in tests/unit, integration, e2e or gpu; none is named for a review round."""
    tests = REPO_ROOT / "tests"
    files = [p.relative_to(tests) for p in tests.rglob("test_*.py")]
    assert files, "no test files found"
    assert [str(f) for f in files if f.parts[0] not in ("unit", "integration", "e2e", "gpu")] == []
    assert [str(f) for f in files if re.search(r"_s[0-9]+\.py$", f.name) or f.name.startswith("test_review_")] == []


def test_the_unit_tier_refuses_a_subprocess():
    """The guard of tests/unit/conftest.py is on inside unit tests: starting a process fails the test."""
    from tests.helpers.isolation import TierViolation
    with pytest.raises(TierViolation, match="subprocess"):
        subprocess.run(["true"])


def test_collection_runs_end_to_end_files_first_and_unit_files_last():
    from tests import conftest

    class Item:
        def __init__(self, rel):
            self.path = Path(conftest.__file__).parent / rel

    items = [Item("unit/test_a.py"), Item("e2e/test_b.py"), Item("integration/x/test_c.py"), Item("unit/y/test_d.py")]
    conftest.pytest_collection_modifyitems(items)
    assert [str(i.path.relative_to(Path(conftest.__file__).parent)) for i in items] == [
        "e2e/test_b.py", "integration/x/test_c.py", "unit/test_a.py", "unit/y/test_d.py"]


# ---- Import boundaries between concerns (issue #14).









# ----------------------------------------------------------------------------- concern boundaries
def test_package_respects_the_boundaries_and_has_no_cycles():
    """The speculative core needs no engine, Ray or Megatron; engines never see the learner; the
    learner reaches neither an engine nor resync (resync/ drives it from cluster/actors.py); no cycles."""
    from tests.helpers.import_graph import cycles, violations
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
    from tests.helpers.import_graph import cycles, violations
    pkg = _plant(tmp_path, {
        "rollout/acceptance.py": "def f():\n    import vllm   # late, still a dependency\n",
        "rollout/speculative.py": "from megatron_specrl.engines.protocol import X\n"      # allowed
                                  "from ..engines import vllm\n",                          # relative, not
        "rollout/store.py": "import ray.util\n",
        "rollout/tree_drafting/trees.py": "from megatron.core import parallel_state\n",
        "engines/protocol.py": "",
        "engines/vllm/engine.py": "from megatron_specrl.learner.worker import LearnerWorker\n",
        "engines/ray_engine.py": "def f():\n    from megatron_specrl.resync.transports import T\n",
        "learner/worker.py": "from megatron_specrl.resync import buckets\n",
        "learner/group.py": "import megatron_specrl.engines.vllm.engine\n",
        "resync/buckets.py": "",
        "a.py": "from megatron_specrl import b, c\n",
        "b.py": "def f():\n    from megatron_specrl.a import g\n",
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from megatron_specrl import d\n",
        "d.py": "def f():\n    from megatron_specrl import c\n",
        # a rule ignores annotations: the core may name an engine type without needing the engine
        "rollout/coupled.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from megatron_specrl.engines import vllm_engine\n",
    })
    found = violations(pkg)
    assert [v.split(":")[0] for v in found] == [
        "megatron_specrl.engines.ray_engine imports megatron_specrl.resync.transports",
        "megatron_specrl.engines.vllm.engine imports megatron_specrl.learner.worker",
        "megatron_specrl.learner.group imports megatron_specrl.engines.vllm.engine",
        "megatron_specrl.learner.worker imports megatron_specrl.resync",
        "megatron_specrl.rollout.acceptance imports vllm",
        "megatron_specrl.rollout.speculative imports megatron_specrl.engines",
        "megatron_specrl.rollout.store imports ray.util",
        "megatron_specrl.rollout.tree_drafting.trees imports megatron.core",
    ], found
    # the late a <-> b import is a cycle, and so is c <-> d, though c imports d for annotations only
    assert cycles(pkg) == [["megatron_specrl.a", "megatron_specrl.b"], ["megatron_specrl.c", "megatron_specrl.d"]]
