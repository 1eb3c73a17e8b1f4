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
