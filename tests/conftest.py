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
