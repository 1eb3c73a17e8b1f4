"""Shared fixtures: tiny checkpoints built once per test session (no downloads)."""

import os
from pathlib import Path

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from megatron_specrl.models.tiny import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    from megatron_specrl.models.tiny import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), arch="qwen2", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    from megatron_specrl.models.tiny import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), arch="qwen3", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory):
    from megatron_specrl.models.tiny import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-moe"), arch="qwen3_moe", seed=0)


@pytest.fixture(autouse=True, scope="module")
def _no_ray_left_to_the_next_module():
    """A test module that leaves Ray initialised in this process (a trainer built in-process, an engine
    test that fails before its own shutdown) would hand the next module its cluster: under pytest-xdist
    each worker runs its own sequence of modules, so the order is not fixed. Shut it down between modules."""
    yield
    import sys
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


# The tiers' order: end-to-end files first, then integration, then unit. pytest-xdist (`--dist loadfile
# --no-loadscope-reorder`, pytest.ini) hands each worker the next file in this order as it finishes one, so the
# runs that take minutes start early and the many short unit files fill the end.
TIER_ORDER = ("e2e", "integration", "gpu", "unit")


def pytest_collection_modifyitems(items):
    """Items sorted by tier (TIER_ORDER), each file's own order kept."""
    root = Path(__file__).resolve().parent

    def tier(item) -> int:
        parts = Path(item.path).resolve().relative_to(root).parts
        return TIER_ORDER.index(parts[0]) if parts and parts[0] in TIER_ORDER else len(TIER_ORDER)

    items.sort(key=tier)


def pytest_terminal_summary(terminalreporter):
    """Each test file's seconds (setup, call and teardown of its tests, summed), the slowest 25 files: what a
    merge or a shared fixture would save, next to --durations' slowest tests (docs/development.md, CI)."""
    per_file: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for r in reports:
            if hasattr(r, "duration") and hasattr(r, "nodeid") and r.nodeid:
                f = r.nodeid.split("::")[0]
                per_file[f] = per_file.get(f, 0.0) + r.duration
    if not per_file:
        return
    terminalreporter.write_sep("=", f"slowest 25 of {len(per_file)} test files (s; {sum(per_file.values()):.0f} in all)")
    for f, s in sorted(per_file.items(), key=lambda kv: -kv[1])[:25]:
        terminalreporter.write_line(f"{s:8.1f}  {f}")
