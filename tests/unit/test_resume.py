"""Review (save and resume): what a resumed run reads back equals what the uninterrupted run holds.

Unit-level: the trajectory store's round trip, the loader's state with DAPO rounds and run-ahead
peeks, a checkpoint that crashes half-way, coupled noise seeds.

What a resumed run must not inherit from the run before it.

1. The rollout dumps (trainer.rollout_data_dir, `{step}.jsonl`) of steps past the step a run starts
   at: moved aside (like the abandoned run's later checkpoints), or read_rollouts would mix two
   timelines once the resumed run stops before rewriting them all.
2. A loader batch size changed since the checkpoint: accepted, but said (one warning line).

Unit level: the functions themselves, and build_run up to Ray (test_resume_older_checkpoint's helpers).

Resuming from an older checkpoint (trainer.resume=<path> at step N while step_M > N of the
abandoned run exist in the same output_dir): the later checkpoints are moved aside, not deleted,
before anything is written, so resume=auto and engine restarts see only the resumed timeline.

Unit level: build_run up to Ray (its checks pass, then a sentinel stops it), and the checkpoint
manager itself.
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
import json
import logging
from tests.helpers import resume as resume_checks
from tests.helpers.rollouts import Tok, _sample
from megatron_specrl.metrics.sinks import MetricsLogger
from megatron_specrl.rollout.dump import dump_rollouts, read_rollouts



# ---- Review (save and resume): what a resumed run reads back equals what the uninterrupted run holds.

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
    from megatron_specrl.run import checkpointing

    good = checkpointing.save_run_checkpoint(_fake_run(tmp_path, 2))
    run = _fake_run(tmp_path, 4)

    def boom(*a, **k):
        raise KeyboardInterrupt("killed")

    if crash_in == "store":
        monkeypatch.setattr(run.store, "save", boom)
    elif crash_in == "trees":
        monkeypatch.setattr(checkpointing, "save_draft_trees", boom)
    else:
        monkeypatch.setattr(ckpt, "_fsync", boom)
    with pytest.raises(KeyboardInterrupt):
        checkpointing.save_run_checkpoint(run)
    latest = ckpt.find_latest(tmp_path / "run" / "checkpoints")
    assert latest == good
    state = ckpt.load_state(latest)
    assert state["step"] == 2 and state["loader"] == _fake_run(tmp_path, 2).loader.state_dict()
    monkeypatch.undo()
    done = checkpointing.save_run_checkpoint(run)   # the next save clears the half-written one
    assert ckpt.find_latest(tmp_path / "run" / "checkpoints") == done
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp-*"))
    assert TrajectoryStore.load(done).get("p", 0).logprobs == [-0.7, -0.2]


# ---- What a resumed run must not inherit from the run before it.

def _dumps(directory, steps):
    for s in steps:
        dump_rollouts(directory, s, [_sample(f"p{s}", 0, [s])], [float(s)], Tok())


def _aside(directory):
    return [p for p in directory.iterdir() if p.is_dir() and p.name.startswith("abandoned-after-")]


# --------------------------------------------------------------------------- rollout dumps

def test_later_dumps_are_moved_aside_whole_and_read_rollouts_skips_them(tmp_path, caplog):
    from megatron_specrl.rollout.dump import set_aside_later_dumps
    d = tmp_path / "rollouts"
    _dumps(d, range(1, 6))
    (d / "6.jsonl.tmp").write_text("half a step\n")      # a crash while step 6 was being written
    (d / "notes.txt").write_text("mine\n")
    before = {p.name: p.read_text() for p in d.glob("*.jsonl")}

    with caplog.at_level(logging.WARNING):
        dest = set_aside_later_dumps(d, 2)

    assert dest.parent == d and dest.name.startswith("abandoned-after-step_00000002-")
    assert sorted(p.name for p in d.iterdir() if p.is_file()) == ["1.jsonl", "2.jsonl", "notes.txt"]
    assert sorted(p.name for p in dest.iterdir()) == ["3.jsonl", "4.jsonl", "5.jsonl", "6.jsonl.tmp"]
    assert all((dest / n).read_text() == t for n, t in before.items() if n not in ("1.jsonl", "2.jsonl"))
    assert list(read_rollouts(d)) == [1, 2]               # the directory's own files only
    assert list(read_rollouts(dest)) == [3, 4, 5]         # the abandoned steps, still readable
    lines = [r.getMessage() for r in caplog.records if "5.jsonl" in r.getMessage()]
    assert len(lines) == 1 and "3.jsonl" in lines[0] and str(dest) in lines[0]

    assert set_aside_later_dumps(d, 2) is None            # nothing later: no directory made
    assert _aside(d) == [dest]
    _dumps(d, [3])
    named = set_aside_later_dumps(d, 2, name=dest.name)   # the same name again: a second directory
    assert named != dest and named.name.startswith(dest.name) and list(read_rollouts(named)) == [3]
    assert set_aside_later_dumps(tmp_path / "none", 0) is None


def test_resume_from_an_older_checkpoint_moves_the_later_dumps_beside_the_checkpoints_name(
        tmp_path, tiny_llama, monkeypatch, caplog):
    out, dumps = tmp_path / "run", tmp_path / "rollouts"
    for s in (2, 4, 6):
        _checkpoint(out, tiny_llama, s)
    _dumps(dumps, range(1, 7))
    with caplog.at_level(logging.WARNING):
        _build(out, tiny_llama, monkeypatch, f"trainer.resume={out / 'checkpoints' / 'step_00000002'}",
               f"trainer.rollout_data_dir={dumps}")
    assert list(read_rollouts(dumps)) == [1, 2]
    [aside] = _aside(dumps)
    [ckpt_aside] = _aside(out / "checkpoints")
    assert aside.name == ckpt_aside.name                  # one name (and time stamp) for both
    assert list(read_rollouts(aside)) == [3, 4, 5, 6]
    assert any("6.jsonl" in r.getMessage() and str(aside) in r.getMessage() for r in caplog.records)


def test_resume_auto_after_a_crash_past_the_last_checkpoint_moves_the_dumps_it_replays(
        tmp_path, tiny_llama, monkeypatch):
    """No later checkpoint, but dumps of steps 3-4 (written before the crash): the resumed run replays
    them from step 2 and may stop before step 4; they go aside so the directory holds one timeline."""
    out, dumps = tmp_path / "run", tmp_path / "rollouts"
    _checkpoint(out, tiny_llama, 2)
    _dumps(dumps, range(1, 5))
    _build(out, tiny_llama, monkeypatch, f"trainer.rollout_data_dir={dumps}")
    assert list(read_rollouts(dumps)) == [1, 2]
    [aside] = _aside(dumps)
    assert aside.name.startswith("abandoned-after-step_00000002-") and list(read_rollouts(aside)) == [3, 4]
    assert not _aside(out / "checkpoints")                # no checkpoint moved

    _build(out, tiny_llama, monkeypatch, f"trainer.rollout_data_dir={dumps}")   # again: nothing more moves
    assert _aside(dumps) == [aside] and list(read_rollouts(dumps)) == [1, 2]


def test_a_fresh_start_moves_an_earlier_runs_dumps_aside_instead_of_overwriting_them(
        tmp_path, tiny_llama, monkeypatch):
    out, dumps = tmp_path / "run", tmp_path / "rollouts"
    _dumps(dumps, [1, 2])
    _build(out, tiny_llama, monkeypatch, f"trainer.rollout_data_dir={dumps}")
    assert not list(dumps.glob("*.jsonl"))
    [aside] = _aside(dumps)
    assert aside.name.startswith("abandoned-after-step_00000000-") and list(read_rollouts(aside)) == [1, 2]


# --------------------------------------------------------------------------- loader batch size

def _leftover_records(n=16):
    return [PromptRecord(id=str(i), prompt=f"p{i}", answer="0", meta={}) for i in range(n)]


def _batch_size_warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "batch_size" in r.getMessage()]


def test_a_changed_batch_size_is_accepted_with_one_warning_naming_both(caplog):
    run = PromptLoader(_leftover_records(), batch_size=4, seed=3)
    for _ in range(5):                                    # into epoch 1
        run.next_batch()
    state = json.loads(json.dumps(run.state_dict()))      # survives a checkpoint file
    assert state["batch_size"] == 4
    whole = PromptLoader(_leftover_records(), batch_size=16, seed=3)     # one batch per epoch: epoch 1's order
    whole.next_batch()
    epoch1 = [r.id for r in whole.next_batch()]

    resumed = PromptLoader(_leftover_records(), batch_size=6, seed=3)
    with caplog.at_level(logging.WARNING):
        resumed.load_state_dict(state)
    [line] = _batch_size_warnings(caplog)
    assert "batch_size=4" in line and "batch_size=6" in line
    # the data order goes on where it was; only the cut of the batches differs
    assert (resumed.epoch, resumed.position) == (1, 4)
    assert [r.id for r in resumed.next_batch()] == epoch1[4:10]


def test_the_same_batch_size_and_an_old_state_load_without_a_word(caplog):
    run = PromptLoader(_leftover_records(), batch_size=4, seed=3)
    run.next_batch()
    state = run.state_dict()
    old = {k: v for k, v in state.items() if k != "batch_size"}   # a checkpoint from before the key
    with caplog.at_level(logging.WARNING):
        PromptLoader(_leftover_records(), batch_size=4, seed=3).load_state_dict(state)
        other = PromptLoader(_leftover_records(), batch_size=8, seed=3)
        other.load_state_dict(old)
    assert _batch_size_warnings(caplog) == []
    assert (other.epoch, other.position) == (0, 4) and "batch_size" in state


def test_resume_with_another_batch_size_warns_and_goes_on(tmp_path, tiny_llama, monkeypatch, caplog):
    resume_checks._checkpoint(tmp_path, tiny_llama, loader={"epoch": 0, "position": 8, "seed": 0, "shuffle": True,
                                                            "num_records": 16, "batch_size": 4})
    with caplog.at_level(logging.WARNING), pytest.raises(resume_checks._ReachedRay):
        resume_checks._build(tmp_path, tiny_llama, monkeypatch)          # trainer.prompts_per_step=8
    [line] = _batch_size_warnings(caplog)
    assert "batch_size=4" in line and "batch_size=8" in line


# ---- Resuming from an older checkpoint (trainer.resume=<path> at step N while step_M > N of the

def _checkpoint(out, model_dir, step, keep=10):
    return resume_checks._checkpoint(out, model_dir, step=step, keep=keep)


def _build(out, model_dir, monkeypatch, *extra):
    with pytest.raises(resume_checks._ReachedRay):
        resume_checks._build(out, model_dir, monkeypatch, *extra)


def _rows(path):
    return [json.loads(ln) for ln in path.read_text().splitlines()]


def test_resume_from_an_older_checkpoint_moves_the_later_ones_aside(tmp_path, tiny_llama, monkeypatch, caplog):
    out = tmp_path / "run"
    root = out / "checkpoints"
    for s in (2, 4, 6):
        _checkpoint(out, tiny_llama, s)
    metrics = "".join(json.dumps({"step": s, "loss": s}) + "\n" for s in range(7))
    (out / "metrics.jsonl").write_text(metrics)
    order = "".join(json.dumps({"step": s, "prompt_ids": [str(s)]}) + "\n" for s in range(1, 7))
    (out / "data_order.jsonl").write_text(order)

    with caplog.at_level(logging.WARNING):
        _build(out, tiny_llama, monkeypatch, f"trainer.resume={root / 'step_00000002'}")

    # only the resumed timeline is left where resume=auto and engine restarts look
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000002"]
    assert ckpt.find_latest(root).name == "step_00000002"
    # nothing deleted: the abandoned run's checkpoints are whole, in one directory beside them
    aside = [p for p in root.iterdir() if p.name.startswith("abandoned-after-step_00000002-")]
    assert len(aside) == 1, list(root.iterdir())
    assert sorted(p.name for p in aside[0].glob("step_*")) == ["step_00000004", "step_00000006"]
    for p in aside[0].glob("step_*"):
        assert ckpt.verify(p) is None
    # the metrics and data order those checkpoints belong to are kept beside them (the resumed run
    # trims its own copies to step 2 when its logger starts)
    assert (aside[0] / "metrics.jsonl").read_text() == metrics
    assert (aside[0] / "data_order.jsonl").read_text() == order
    # one line saying what moved and where
    lines = [r.getMessage() for r in caplog.records if "step_00000004" in r.getMessage()]
    assert len(lines) == 1 and "step_00000006" in lines[0] and str(aside[0]) in lines[0]

    # the resumed run writes step 3 and crashes: resume=auto continues the resumed timeline,
    # not the abandoned step 6
    _checkpoint(out, tiny_llama, 3)
    assert ckpt.find_latest(root).name == "step_00000003"
    assert {p.name for p in aside[0].glob("step_*")} == {"step_00000004", "step_00000006"}


def test_a_resume_before_the_first_new_checkpoint_still_sees_the_resumed_one(tmp_path, tiny_llama, monkeypatch):
    """A crash (or an engine restart, which loads draft trees from the newest checkpoint) before the
    resumed run's first checkpoint: the newest is the one it resumed from, not the abandoned run's."""
    out = tmp_path / "run"
    root = out / "checkpoints"
    for s in (2, 4):
        _checkpoint(out, tiny_llama, s)
    _build(out, tiny_llama, monkeypatch, f"trainer.resume={root / 'step_00000002'}")
    assert ckpt.find_latest(root).name == "step_00000002"
    _build(out, tiny_llama, monkeypatch)               # resume=auto: the same timeline, nothing more moves
    assert ckpt.find_latest(root).name == "step_00000002"
    assert len([p for p in root.iterdir() if p.name.startswith("abandoned-")]) == 1


def test_resume_from_the_newest_checkpoint_moves_nothing(tmp_path, tiny_llama, monkeypatch):
    out = tmp_path / "run"
    root = out / "checkpoints"
    for s in (2, 4):
        _checkpoint(out, tiny_llama, s)
    _build(out, tiny_llama, monkeypatch)                                    # resume=auto
    _build(out, tiny_llama, monkeypatch, f"trainer.resume={root / 'step_00000004'}")
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000004"]


def test_set_aside_twice_in_one_second_keeps_both(tmp_path):
    """Two abandoned timelines after the same step (resumed twice from it) go to two directories."""
    root = tmp_path / "checkpoints"
    for s in (2, 5):
        tmp = ckpt.begin(root, s)
        ckpt.commit(tmp, {"step": s, "weight_version": s}, keep=10)
    first = ckpt.set_aside_newer(root, 2)
    tmp = ckpt.begin(root, 5)
    ckpt.commit(tmp, {"step": 5, "weight_version": 5}, keep=10)
    second = ckpt.set_aside_newer(root, 2)
    assert first != second and (first / "step_00000005").is_dir() and (second / "step_00000005").is_dir()
    assert ckpt.set_aside_newer(root, 2) is None                        # nothing newer: nothing made
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000002"]


def test_metrics_and_data_order_are_trimmed_to_the_resumed_step(tmp_path):
    """build_run gives the logger the resumed checkpoint's step (N), not the newest checkpoint's."""
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(7)))
    (tmp_path / "data_order.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 7)))
    MetricsLogger(tmp_path, {}, use_wandb=False, wandb_mode="disabled", project="p", run_name=None, resume_step=2)
    assert [r["step"] for r in _rows(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    assert [r["step"] for r in _rows(tmp_path / "data_order.jsonl")] == [1, 2]
