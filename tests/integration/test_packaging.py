"""A wheel works outside the checkout (issue #56): the recipes (examples/) and the GPU stack's version pins
(docker/constraints-gpu.txt) travel in it as package data, and `train <recipe> --dry-run` finds them.

The wheel is built from a copy of the files setup.py reads (pip builds in the source tree, which would
leave build/ and an egg-info in the checkout), installed into a throwaway target directory, and run from
a directory outside the repository. The venv's own install of the package is editable: its finder sits
at the end of sys.meta_path, so a PYTHONPATH entry wins for `megatron_specrl`, and the test checks that
the wheel's copy is what ran. A dry run builds no model (the tiny model's config is known without it):
MEGATRON_SPECRL_CACHE points at an empty directory, and the test checks that it stays empty.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import REPO_ROOT

pytestmark = pytest.mark.slow

# What setup.py reads or maps into the wheel (the package, patches/, examples/, docker/, the readme).
BUILD_INPUTS = ("setup.py", "README.md", "LICENSE", "megatron_specrl", "patches", "examples", "docker")


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel built from this checkout and installed (no dependencies) into a target directory."""
    root = tmp_path_factory.mktemp("packaging")
    src = root / "src"
    src.mkdir()
    for name in BUILD_INPUTS:
        path = REPO_ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    wheels = root / "wheels"
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
                  str(src)])
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = wheels.glob("megatron_specrl-*.whl")
    site = root / "site"
    done = _run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)])
    assert done.returncode == 0, done.stdout + done.stderr
    return site


def _env(site: Path, cache: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(site), "MEGATRON_SPECRL_CACHE": str(cache)}


def test_the_wheel_carries_the_recipes_and_the_version_pins(installed):
    data = installed / "megatron_specrl" / "_data"
    assert sorted(p.name for p in (data / "examples").glob("*.yaml")) == sorted(
        p.name for p in (REPO_ROOT / "examples").glob("*.yaml"))
    for rel in ("examples/models", "examples/data"):
        assert sorted(p.relative_to(data) for p in (data / rel).rglob("*") if p.is_file()) == sorted(
            p.relative_to(REPO_ROOT) for p in (REPO_ROOT / rel).rglob("*") if p.is_file())
    assert (data / "docker" / "constraints-gpu.txt").read_text() == (
        REPO_ROOT / "docker" / "constraints-gpu.txt").read_text()


def test_a_dry_run_from_the_wheel_outside_the_checkout_finds_its_recipe(installed, tmp_path):
    cwd, cache = tmp_path / "elsewhere", tmp_path / "cache"
    cwd.mkdir()
    cache.mkdir()
    where = _run([sys.executable, "-c", "import megatron_specrl; print(megatron_specrl.__file__)"],
                 cwd=cwd, env=_env(installed, cache))
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(installed), where.stdout   # the wheel's, not the checkout's
    run = _run([sys.executable, "-m", "megatron_specrl.cli", "train", "tiny-cpu-grpo", "--dry-run"],
               cwd=cwd, env=_env(installed, cache))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "plan: outputs/tiny-cpu-grpo" in run.stdout and "tiny-llama" in run.stdout
    assert list(cache.iterdir()) == []                           # no model built, nothing trained
    assert list(cwd.iterdir()) == []                             # and nothing written
    # a cluster recipe's shape-only model and sample data ship too: its dry run passes offline
    run = _run([sys.executable, "-m", "megatron_specrl.cli", "train", "qwen2.5-7b-dapo-1node", "--dry-run"],
               cwd=cwd, env=_env(installed, cache))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "qwen2.5-7b" in run.stdout and "shape only" in run.stdout


def test_the_gpu_stack_check_reads_the_pins_of_the_wheel(installed, tmp_path):
    where = _run([sys.executable, "-c", "from megatron_specrl.cluster import gpu_stack as g; print(g.CONSTRAINTS); "
                                        "print(g.read_pins(g.CONSTRAINTS)['vllm'])"],
                 cwd=tmp_path, env=_env(installed, tmp_path / "cache"))
    assert where.returncode == 0, where.stderr
    constraints, vllm = where.stdout.split()
    assert Path(constraints).is_relative_to(installed), constraints
    assert f"vllm=={vllm}" in (REPO_ROOT / "docker" / "constraints-gpu.txt").read_text()
