"""Resuming from an older checkpoint (trainer.resume=<path> at step N while step_M > N of the
abandoned run exist in the same output_dir): the later checkpoints are moved aside, not deleted,
before anything is written, so resume=auto and engine restarts see only the resumed timeline.

Unit level: build_run up to Ray (its checks pass, then a sentinel stops it), and the checkpoint
manager itself.
"""

import json
import logging

import pytest
import test_review_metrics_resume_mismatch as resume_checks

from megatron_specrl import checkpoint as ckpt
from megatron_specrl.metrics import MetricsLogger


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
