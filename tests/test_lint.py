"""Undefined names, stale imports and unused variables fail the suite (pyflakes rules via ruff)."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_no_pyflakes_errors():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    proc = subprocess.run([ruff, "check", "--select", "F", "--output-format", "concise",
                           "megatron_specrl", "tools", "tests", "patches"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_suites_longest_files_exist_and_go_first():
    """conftest.LONGEST_FILES orders the files pytest-xdist hands out; a renamed file would silently lose
    its place, so every name must be a test file here, and the collection must start with them."""
    import conftest
    tests = Path(__file__).resolve().parent
    assert [n for n in conftest.LONGEST_FILES if not (tests / n).is_file()] == []
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider"],
                          cwd=tests.parent, capture_output=True, text=True, timeout=300)
    files = list(dict.fromkeys(ln.split("::")[0].split("/")[-1] for ln in proc.stdout.splitlines() if "::" in ln))
    assert files[:len(conftest.LONGEST_FILES)] == list(conftest.LONGEST_FILES), proc.stderr[-2000:]
