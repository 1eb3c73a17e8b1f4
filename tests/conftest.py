"""Shared fixtures: tiny checkpoints built once per test session (no downloads)."""

import os

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


def pytest_collection_modifyitems(items):
    """Files with end-to-end (`slow`) tests first, each file's own order kept: pytest-xdist hands a worker
    the next file as it finishes one, so a long file started last would run alone while the other worker
    has nothing left."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)
