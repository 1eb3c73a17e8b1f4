"""metrics.jsonl across a crash: the resume-time truncation must never lose the rows it keeps."""

import json
import subprocess
import sys
import textwrap

from megatron_specrl.metrics import read_metrics


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
        from megatron_specrl.metrics import truncate_jsonl
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)       # a write past the limit raises EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))
        truncate_jsonl(Path({str(path)!r}), 30)
    """)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "File too large" in proc.stderr, proc.stderr[-2000:]
    assert [r["step"] for r in read_metrics(path)] == list(range(1, 41))
