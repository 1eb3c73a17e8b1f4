"""MetricsLogger's JSONL: what a run starting at a given step keeps of an earlier run's rows."""

import json

from megatron_specrl.metrics import MetricsLogger, read_metrics


def _logger(out, resume_step):
    return MetricsLogger(out, {}, use_wandb=False, wandb_mode="disabled", project="p", run_name=None,
                         resume_step=resume_step)


def test_a_run_from_step_0_keeps_no_row_of_an_earlier_run(tmp_path):
    """The trainer logs the step-0 eval whenever it starts at step 0 (fresh, or resumed before the
    first checkpoint): an earlier run's step-0 row must not stay beside it."""
    old = _logger(tmp_path, 0)
    for step, acc in ((0, 0.25), (1, 0.3), (2, 0.5)):
        old.log(step, {"eval/accuracy": acc})
    new = _logger(tmp_path, 0)
    new.log(0, {"eval/accuracy": 0.75})
    assert [(r["step"], r["eval/accuracy"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [(0, 0.75)]


def test_a_resumed_run_keeps_the_rows_up_to_its_checkpoint(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "x": 1.0}) + "\n" for s in range(4))
                                            + '{"step": 4, "x"')     # torn last line
    _logger(tmp_path, 2)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]
