"""Review (save and resume): what a resumed run reads back equals what the uninterrupted run holds.

Unit-level: the trajectory store's round trip, the loader's state with DAPO rounds and run-ahead
peeks, a checkpoint that crashes half-way, coupled noise seeds.
"""

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_specrl import checkpoint as ckpt
from megatron_specrl.data.datasets import PromptLoader, PromptRecord
from megatron_specrl.rollout.acceptance import decide
from megatron_specrl.rollout.store import Trajectory, TrajectoryStore


# ---------------------------------------------------------------- 1. log-probs across a checkpoint

def _round_trip(store: TrajectoryStore, tmp_path) -> TrajectoryStore:
    store.save(tmp_path)
    return TrajectoryStore.load(tmp_path)


def test_store_round_trip_is_bit_exact_for_any_logprob(tmp_path):
    """The store is what a resumed run drafts from: it must read back exactly what the uninterrupted
    run keeps in memory (Python floats, i.e. float64), not a float32 rounding of it."""
    lps = [-0.7, -0.1, -1 / 3, -1e-12, -123.456789, float("-inf"), -2.0 ** -30]
    store = TrajectoryStore()
    store.put("p", 0, Trajectory(list(range(len(lps))), list(lps), "stop", 5))
    back = _round_trip(store, tmp_path)
    assert back.get("p", 0).logprobs == store.get("p", 0).logprobs
    assert all(type(x) is float for x in back.get("p", 0).logprobs)


def test_lenient_acceptance_of_a_resumed_run_equals_the_uninterrupted_runs(tmp_path):
    """spec_mode=lenient compares new log-probs p with the stored q: u < min(1, l exp(p - q)).
    With q = -0.7 kept in memory and the new policy giving p = -0.7 too, the uninterrupted run
    accepts with probability 1; after a float32 round trip q = -0.69999998..., the acceptance
    probability drops below 1 and a uniform just below 1 rejects: the resumed run diverges."""
    store = TrajectoryStore()
    store.put("p", 0, Trajectory([3, 4], [-0.7, -0.7], "stop", 1))
    p = [-0.7, -0.7]
    uniforms = np.array([1.0 - 1e-10, 0.5])
    live = decide([3, 4], p, store.get("p", 0).logprobs, uniforms, "lenient", 1.0)
    resumed = decide([3, 4], p, _round_trip(store, tmp_path).get("p", 0).logprobs, uniforms, "lenient", 1.0)
    assert live.num_accepted == 2
    assert resumed.num_accepted == live.num_accepted


def test_store_round_trip_keeps_tokens_seeds_versions_and_order(tmp_path):
    store = TrajectoryStore()
    big = 2 ** 40   # a token id past int32 (no tokenizer has one, but the store must not wrap it)
    store.put("b", 1, Trajectory([big, 7], [-0.5, -0.25], "length", 3, noise_seed=2 ** 63 - 1))
    store.put("a", 0, Trajectory([], [], "stop", 2, noise_seed=0))
    store.put("c", 2, Trajectory([1], [-1.0], "stop", 4))
    back = _round_trip(store, tmp_path)
    assert list(back._items) == list(store._items)
    for key, t in store._items.items():
        assert back._items[key] == t


def test_a_checkpoint_written_before_float64_logprobs_still_loads(tmp_path):
    """Stores saved with float32 log-probs and int64 token ids (earlier versions) load as before."""
    import json
    np.savez(tmp_path / "trajectories.npz", token_ids=np.array([5, 6], dtype=np.int64),
             logprobs=np.array([-0.5, -0.25], dtype=np.float32), lengths=np.array([2], dtype=np.int64),
             versions=np.array([1], dtype=np.int64), noise_seeds=np.array([-1], dtype=np.int64))
    (tmp_path / "trajectories.json").write_text(json.dumps({"keys": [["p", 0]], "finish": ["stop"]}))
    t = TrajectoryStore.load(tmp_path).get("p", 0)
    assert t == Trajectory([5, 6], [-0.5, -0.25], "stop", 1, None)


# ---------------------------------------------------------------- 2. loader: DAPO rounds, run-ahead peeks

def _records(n=10):
    return [PromptRecord(id=f"r{i}", prompt=f"q{i}", answer=str(i)) for i in range(n)]


def _ids(batch):
    return [r.id for r in batch]


def test_peek_changes_neither_the_loader_nor_any_global_rng():
    loader = PromptLoader(_records(), batch_size=4, seed=3)
    random.seed(11)
    np.random.seed(11)
    torch.manual_seed(11)
    states = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state().clone())
    for _ in range(5):   # over epoch ends too (10 records, batches of 4: an epoch is 2 batches)
        before = loader.state_dict()
        peeked = _ids(loader.peek_batch())
        assert loader.state_dict() == before
        assert _ids(loader.next_batch()) == peeked
    assert random.getstate() == states[0]
    assert (np.random.get_state()[1] == states[1]).all()
    assert torch.equal(torch.get_rng_state(), states[2])


def test_dapo_rounds_after_a_resume_draw_the_same_prompts():
    """gen_prompts_per_step > prompts_per_step: a step takes 1..3 loader batches (rounds), each
    round peeking the next (run-ahead). A loader restored from the state saved after step s draws
    the same rounds as the uninterrupted one from step s + 1 on."""
    rounds_per_step = [1, 3, 2, 1, 2, 3, 1]

    def run(loader, steps):
        out = []
        for n in steps:
            step = []
            for _ in range(n):
                batch = _ids(loader.next_batch())
                ahead = _ids(loader.peek_batch())
                step.append((batch, ahead))
            out.append(step)
        return out

    full = run(PromptLoader(_records(), 4, seed=5), rounds_per_step)
    for s in range(1, len(rounds_per_step)):
        first = PromptLoader(_records(), 4, seed=5)
        run(first, rounds_per_step[:s])
        resumed = PromptLoader(_records(), 4, seed=5)
        resumed.load_state_dict(first.state_dict())
        assert run(resumed, rounds_per_step[s:]) == full[s:]


# ---------------------------------------------------------------- 3. a checkpoint that crashes half-way

class _Learner:
    def save_checkpoint(self, path):
        from pathlib import Path
        Path(path).mkdir(parents=True)
        (Path(path) / "shard.bin").write_bytes(b"weights")


def _fake_run(tmp_path, step):
    model_dir = tmp_path / "model"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text("{}")
    store = TrajectoryStore()
    store.put("p", 0, Trajectory([1, 2], [-0.7, -0.2], "stop", step))
    loader = PromptLoader(_records(), 4, seed=1)
    for _ in range(step):
        loader.next_batch()
    return SimpleNamespace(out=tmp_path / "run", learner=_Learner(), critic=None, reward_kl=None, store=store, engine=object(),
                           model_dir=model_dir, step=step, version=step, loader=loader, tokenizer_id="tok",
                           cfg=SimpleNamespace(trainer=SimpleNamespace(keep_checkpoints=2)))


@pytest.mark.parametrize("crash_in", ["store", "trees", "commit"])
def test_a_checkpoint_killed_half_way_leaves_the_previous_one_as_latest(tmp_path, monkeypatch, crash_in):
    from megatron_specrl import run_setup

    good = run_setup.save_run_checkpoint(_fake_run(tmp_path, 2))
    run = _fake_run(tmp_path, 4)

    def boom(*a, **k):
        raise KeyboardInterrupt("killed")

    if crash_in == "store":
        monkeypatch.setattr(run.store, "save", boom)
    elif crash_in == "trees":
        monkeypatch.setattr(run_setup, "save_draft_trees", boom)
    else:
        monkeypatch.setattr(ckpt, "_fsync", boom)
    with pytest.raises(KeyboardInterrupt):
        run_setup.save_run_checkpoint(run)
    latest = ckpt.find_latest(tmp_path / "run" / "checkpoints")
    assert latest == good
    state = ckpt.load_state(latest)
    assert state["step"] == 2 and state["loader"] == _fake_run(tmp_path, 2).loader.state_dict()
    monkeypatch.undo()
    done = run_setup.save_run_checkpoint(run)   # the next save clears the half-written one
    assert ckpt.find_latest(tmp_path / "run" / "checkpoints") == done
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp-*"))
    assert TrajectoryStore.load(done).get("p", 0).logprobs == [-0.7, -0.2]
