"""MetricsLogger's JSONL: what a run starting at a given step keeps of an earlier run's rows.

The tests of this subject that start processes or engines; the rest are in tests/unit/test_metrics.py.
"""

import json
from megatron_specrl.metrics.sinks import read_metrics
import subprocess
import sys
import textwrap


from tests.helpers.wandb import _wandb_logger  # noqa: F401

def test_truncation_that_fails_midway_keeps_the_file(tmp_path):
    """truncate_jsonl rewrites the file at every start; a kill or a full disk in the middle of that
    rewrite must leave the old file whole (rewritten in place it would be left empty or cut).
    A file-size limit in a child process makes the rewrite fail partway, like a full disk."""
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "reward/mean": 0.5, "pad": "x" * 200} for s in range(1, 41)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    child = textwrap.dedent(f"""
        import resource, signal
        from pathlib import Path
        from megatron_specrl.metrics.sinks import truncate_jsonl
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)       # a write past the limit raises EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))
        truncate_jsonl(Path({str(path)!r}), 30)
    """)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "File too large" in proc.stderr, proc.stderr[-2000:]
    assert [r["step"] for r in read_metrics(path)] == list(range(1, 41))


def test_real_wandb_offline_accepts_the_step_metric(tmp_path, monkeypatch):
    """The calls above against the installed wandb, offline (no network): a resumed logger works
    and the step metric reaches the run's history file."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    first = _wandb_logger(tmp_path, 0, mode="offline")
    first.log(1, {"reward/mean": 1.0})
    first.close()
    second = _wandb_logger(tmp_path, 0 + 1, mode="offline")
    second.log(2, {"reward/mean": 2.0})
    second.close()
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith((tmp_path / "wandb_run_id").read_text()) for r in runs)


