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


# The longest files, longest first: each file's total seconds in a serial run of the whole suite (session 32's,
# before the recipe tests shared the warm-up cache). pytest-xdist (`--dist loadfile --no-loadscope-reorder`,
# pytest.ini) hands each worker the next file in this order as it finishes one, so the long files start early
# and the short ones fill the end: in session 34's CI, whose order xdist had re-sorted by tests per file, the
# 197 s `test_resume.py` started last and ran alone. A file missing here only loses its place in the queue.
LONGEST_FILES = (
    "test_recipes_e2e.py", "test_resume.py", "test_distributed_optimizer_e2e.py", "test_learner_layouts.py",
    "test_launch.py", "test_resync_transport_e2e.py", "test_placement.py", "test_kl_in_reward.py",
    "test_coupled.py", "test_draft_model.py", "test_bench_rollout.py", "test_lr_warmup.py",
    "test_review_fanout_waits.py", "test_resync_check.py", "test_distributed_optimizer.py",
    "test_reference_model.py", "test_learner_settings_parity.py", "test_speculative_exactness.py",
    "test_engine_failures.py", "test_check_resync_engine_tp.py", "test_review_resync_routes.py",
    "test_tree_drafting.py",
)


def pytest_collection_modifyitems(items):
    """The files of LONGEST_FILES first, in its order, then the other files with end-to-end (`slow`) tests,
    then the rest; each file's own order kept."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank) + (item.path not in slow_files)))
