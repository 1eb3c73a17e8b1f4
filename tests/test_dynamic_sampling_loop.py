"""DAPO dynamic sampling inside the training loop: fills the batch, or fails clearly (no hang)."""

from types import SimpleNamespace

import pytest
import torch

import megatron_specrl.rollout.dynamic as dynamic
from megatron_specrl.algorithms.dapo import DynamicSamplingError
from megatron_specrl.config import load_config
from megatron_specrl.rollout.speculative import RolloutSample


def _samples(group_rewards: dict[str, list[float]]):
    samples, rewards = [], []
    for pid, rs in group_rewards.items():
        for k, r in enumerate(rs):
            samples.append(RolloutSample(pid, k, [5], [9, 1], [-0.1, -0.1], "stop", 0, 0))
            rewards.append(r)
    t = torch.tensor(rewards)
    return samples, t, t.clone(), {"spec/rollout_s": 0.5, "reward/mean": float(t.mean())}


def _run(**over):
    cfg = load_config(None, ["algorithm.name=dapo", "algorithm.dynamic_sampling=true",
                             "trainer.prompts_per_step=2", "rollout.n_samples=2",
                             *[f"{k}={v}" for k, v in over.items()]])
    return SimpleNamespace(cfg=cfg)


def test_all_groups_filtered_raises_after_max_tries(monkeypatch):
    calls = []

    def round_(run, step, idx):
        calls.append(idx)
        return _samples({f"a{idx}": [1.0, 1.0], f"b{idx}": [0.0, 0.0]})   # all-correct / all-wrong

    monkeypatch.setattr(dynamic, "_rollout_round", round_)
    with pytest.raises(DynamicSamplingError, match="0/2 groups after 3 rounds"):
        dynamic.collect_rollouts(_run(**{"algorithm.max_sampling_tries": 3}), step=1)
    assert calls == [0, 1, 2]


def test_rounds_accumulate_until_the_batch_is_full(monkeypatch):
    rounds = [{"a": [1.0, 0.0], "b": [1.0, 1.0]}, {"c": [0.0, 0.0], "d": [0.0, 1.0], "e": [1.0, 0.0]}]
    monkeypatch.setattr(dynamic, "_rollout_round", lambda run, step, idx: _samples(rounds[idx]))
    samples, rewards, metrics = dynamic.collect_rollouts(_run(), step=1)
    assert [s.prompt_id for s in samples] == ["a", "a", "d", "d"]       # exactly 2 informative groups
    assert rewards.tolist() == [1.0, 0.0, 0.0, 1.0]
    assert metrics["dapo/rounds"] == 2 and metrics["spec/rollout_s"] == 1.0   # seconds add up over rounds


def test_without_dynamic_sampling_one_round(monkeypatch):
    monkeypatch.setattr(dynamic, "_rollout_round", lambda run, step, idx: _samples({"a": [1.0, 1.0]}))
    cfg = load_config(None, ["trainer.prompts_per_step=2", "rollout.n_samples=2"])
    samples, rewards, _ = dynamic.collect_rollouts(SimpleNamespace(cfg=cfg), step=1)
    assert len(samples) == 2 and rewards.tolist() == [1.0, 1.0]
