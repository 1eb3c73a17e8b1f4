"""What a resumed run must not inherit from the run before it.

1. The rollout dumps (trainer.rollout_data_dir, `{step}.jsonl`) of steps past the step a run starts
   at: moved aside (like the abandoned run's later checkpoints), or read_rollouts would mix two
   timelines once the resumed run stops before rewriting them all.
2. A loader batch size changed since the checkpoint: accepted, but said (one warning line).

Unit level: the functions themselves, and build_run up to Ray (test_resume_older_checkpoint's helpers).
"""

import json
import logging

import pytest
import test_review_metrics_resume_mismatch as resume_checks
from test_resume_older_checkpoint import _build, _checkpoint
from test_rollout_dump import Tok, _sample

from megatron_specrl.data.datasets import PromptLoader, PromptRecord
from megatron_specrl.rollout.dump import dump_rollouts, read_rollouts


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

def _records(n=16):
    return [PromptRecord(id=str(i), prompt=f"p{i}", answer="0", meta={}) for i in range(n)]


def _batch_size_warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "batch_size" in r.getMessage()]


def test_a_changed_batch_size_is_accepted_with_one_warning_naming_both(caplog):
    run = PromptLoader(_records(), batch_size=4, seed=3)
    for _ in range(5):                                    # into epoch 1
        run.next_batch()
    state = json.loads(json.dumps(run.state_dict()))      # survives a checkpoint file
    assert state["batch_size"] == 4
    whole = PromptLoader(_records(), batch_size=16, seed=3)     # one batch per epoch: epoch 1's order
    whole.next_batch()
    epoch1 = [r.id for r in whole.next_batch()]

    resumed = PromptLoader(_records(), batch_size=6, seed=3)
    with caplog.at_level(logging.WARNING):
        resumed.load_state_dict(state)
    [line] = _batch_size_warnings(caplog)
    assert "batch_size=4" in line and "batch_size=6" in line
    # the data order goes on where it was; only the cut of the batches differs
    assert (resumed.epoch, resumed.position) == (1, 4)
    assert [r.id for r in resumed.next_batch()] == epoch1[4:10]


def test_the_same_batch_size_and_an_old_state_load_without_a_word(caplog):
    run = PromptLoader(_records(), batch_size=4, seed=3)
    run.next_batch()
    state = run.state_dict()
    old = {k: v for k, v in state.items() if k != "batch_size"}   # a checkpoint from before the key
    with caplog.at_level(logging.WARNING):
        PromptLoader(_records(), batch_size=4, seed=3).load_state_dict(state)
        other = PromptLoader(_records(), batch_size=8, seed=3)
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
