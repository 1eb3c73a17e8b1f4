"""The end of a run's checkpoints (run/checkpointing.py): train saves the last step's unless
trainer.checkpoint_every is off or has just saved it (Run.finish, which runs after it, saves nothing)."""

from __future__ import annotations

from types import SimpleNamespace

from megatron_specrl import checkpoint as ckpt
from megatron_specrl.run import checkpointing


def _run(tmp_path, step: int, every: int):
    return SimpleNamespace(out=tmp_path, step=step, cfg=SimpleNamespace(trainer=SimpleNamespace(checkpoint_every=every)))


def test_the_final_checkpoint_is_saved_once_and_only_with_checkpointing_on(tmp_path, monkeypatch):
    saved = []
    monkeypatch.setattr(checkpointing, "save_run_checkpoint", lambda run: saved.append(run.step) or tmp_path / "x")
    assert checkpointing.save_final_checkpoint(_run(tmp_path, 5, every=0)) is None and saved == []
    assert checkpointing.save_final_checkpoint(_run(tmp_path, 5, every=2)) == tmp_path / "x" and saved == [5]
    (tmp_path / "checkpoints" / ckpt.step_dir_name(6)).mkdir(parents=True)   # checkpoint_every saved step 6
    assert checkpointing.save_final_checkpoint(_run(tmp_path, 6, every=2)) is None and saved == [5]
