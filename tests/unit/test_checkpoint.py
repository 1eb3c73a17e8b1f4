"""Atomic checkpoints: complete ones are found, half-written or damaged ones skipped.
"""

import json
from pathlib import Path
from megatron_specrl import checkpoint as ckpt

def _write(root, step, payload=b"weights"):
    tmp = ckpt.begin(root, step)
    (tmp / "learner").mkdir()
    (tmp / "learner" / "shard.bin").write_bytes(payload)
    return ckpt.commit(tmp, {"step": step, "weight_version": step}, keep=3)


def test_latest_complete_checkpoint_wins(tmp_path):
    _write(tmp_path, 10)
    latest = _write(tmp_path, 20)
    assert ckpt.find_latest(tmp_path) == latest
    assert ckpt.load_state(latest)["step"] == 20


def test_half_written_and_damaged_are_skipped(tmp_path, caplog):
    good = _write(tmp_path, 10)
    bad = _write(tmp_path, 20)
    ckpt.begin(tmp_path, 30)                       # killed while writing: only a .tmp dir
    (bad / "learner" / "shard.bin").write_bytes(b"flipped")
    assert ckpt.find_latest(tmp_path) == good
    assert "does not match its checksum" in caplog.text and "half-written" in caplog.text


def test_missing_manifest_means_incomplete(tmp_path):
    good = _write(tmp_path, 10)
    (good / ckpt.MANIFEST).unlink()
    assert ckpt.find_latest(tmp_path) is None
    assert ckpt.verify(good) == "no manifest (half-written)"


def test_keep_prunes_oldest(tmp_path):
    for s in (1, 2, 3, 4, 5):
        _write(tmp_path, s)
    assert [p.name for p in sorted(tmp_path.glob("step_*"))] == ["step_00000003", "step_00000004", "step_00000005"]
    manifest = json.loads((tmp_path / "step_00000005" / ckpt.MANIFEST).read_text())
    assert "learner/shard.bin" in manifest["files"] and "trainer_state.json" in manifest["files"]


def test_resume_with_another_tokenizer_is_refused(tmp_path):
    import pytest
    from megatron_specrl.config import ConfigError

    state = {"step": 4, "tokenizer": "aaaa"}
    ckpt.check_tokenizer(state, tmp_path, "aaaa", tmp_path)            # same tokenizer: fine
    with pytest.raises(ConfigError, match="tokenizer mismatch: checkpoint .* tokenizer aaaa, model.path .* has bbbb"):
        ckpt.check_tokenizer(state, tmp_path, "bbbb", tmp_path)


def test_resume_from_a_damaged_path_names_the_problem(tmp_path):
    import pytest
    from megatron_specrl.config import ConfigError, load_config
    from megatron_specrl.run.checkpointing import find_resume

    bad = _write(tmp_path, 10)
    (bad / "learner" / "shard.bin").write_bytes(b"flipped")
    cfg = load_config(None, [f"trainer.resume={bad}"])
    with pytest.raises(ConfigError, match=r"trainer.resume=.*step_00000010.*learner/shard.bin does not match its checksum"):
        find_resume(cfg, tmp_path)
    cfg = load_config(None, [f"trainer.resume={tmp_path / 'nowhere'}"])
    with pytest.raises(ConfigError, match="not a directory"):
        find_resume(cfg, tmp_path)


def test_prune_never_drops_the_checkpoint_just_written(tmp_path):
    """resume=auto skips a damaged newest checkpoint and resumes from an older one; the checkpoints
    the resumed run writes must survive pruning, which must not count the damaged later one."""
    _write(tmp_path, 4)
    bad = _write(tmp_path, 6)
    (bad / "learner" / "shard.bin").write_bytes(b"flipped")
    assert ckpt.find_latest(tmp_path).name == "step_00000004"       # the run resumes at step 4
    tmp = ckpt.begin(tmp_path, 5)
    (tmp / "learner").mkdir()
    (tmp / "learner" / "shard.bin").write_bytes(b"weights")
    written = ckpt.commit(tmp, {"step": 5, "weight_version": 5}, keep=1)
    assert written.is_dir() and ckpt.find_latest(tmp_path) == written
    assert not (tmp_path / "step_00000004").exists()                 # keep=1: the older one goes


def test_a_crashed_writes_temporary_directory_is_removed_by_the_next_save(tmp_path):
    """A crash mid-write leaves a .tmp directory holding a whole checkpoint's bytes; resume never
    reads it, so the next save removes it (disk use no longer grows with every such crash)."""
    stale = ckpt.begin(tmp_path, 30)
    (stale / "learner").mkdir()
    (stale / "learner" / "shard.bin").write_bytes(b"x" * 1024)
    done = _write(tmp_path, 40)
    assert not stale.exists() and [p.name for p in tmp_path.iterdir()] == [done.name]


def test_commit_fsyncs_every_file_and_directory_before_pruning(tmp_path, monkeypatch):
    """Only the manifest was fsynced: after a node crash the newest checkpoint could be page cache only
    while the older ones were already pruned."""
    import megatron_specrl.checkpoint as ck

    events = []
    monkeypatch.setattr(ck, "_fsync", lambda p: events.append(("fsync", Path(p).name)))
    real_prune = ck._prune
    monkeypatch.setattr(ck, "_prune", lambda *a: (events.append(("prune", "")), real_prune(*a)))
    for step in (1, 2):
        tmp = ck.begin(tmp_path / "checkpoints", step)
        (tmp / "learner").mkdir()
        (tmp / "learner" / "w.bin").write_bytes(b"x" * 10)
        ck.commit(tmp, {"step": step}, keep=1)
    synced = {name for kind, name in events if kind == "fsync"}
    assert {"w.bin", "trainer_state.json", "learner", "checkpoints"} <= synced
    assert events.index(("fsync", "checkpoints")) < events.index(("prune", ""))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000002"]
