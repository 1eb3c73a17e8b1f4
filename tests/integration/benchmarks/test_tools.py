"""The benchmark tools' arithmetic: benchmarks/replay_drafts.py and benchmarks/bench_own_draft.py,

The tests of this subject that start processes or engines; the rest are in tests/unit/benchmarks/test_tools.py.
"""

from __future__ import annotations
import json
import subprocess
import sys
import pytest
import torch
from tests.helpers.paths import REPO_ROOT


from tests.helpers.benchmarks import _rows, _tool

TOOLS = REPO_ROOT / "benchmarks"


class _Stepper:
    """Stands in for a vLLM class whose method --phases times."""
    calls = 0

    def step(self, x, scale=1):
        _Stepper.calls += 1
        return x * scale


def test_bench_own_draft_phases_name_vllms_methods_and_add_up_wall_time(monkeypatch):
    """`--phases` wraps vLLM methods by name: each must exist in the installed vLLM (a rename would
    otherwise fail only when someone runs the tool), and a wrapped method must return its result and
    add its seconds to its label on every call."""
    import importlib
    import time

    bench_own_draft = _tool("bench_own_draft")
    for path, name, _ in bench_own_draft.PHASES:
        module, cls = path.rsplit(".", 1)
        assert callable(getattr(getattr(importlib.import_module(module), cls), name)), (path, name)

    monkeypatch.setattr(bench_own_draft, "PHASES", ((f"{__name__}._Stepper", "step", "stepping"),))
    monkeypatch.setattr(_Stepper, "step", _Stepper.step)       # restored after the test
    monkeypatch.setattr(_Stepper, "calls", 0)
    totals = {}
    bench_own_draft.time_phases(totals)
    t = time.perf_counter()
    assert _Stepper().step(3, scale=2) == 6 and _Stepper().step(1) == 1
    elapsed = time.perf_counter() - t
    assert _Stepper.calls == 2 and set(totals) == {"stepping"} and 0 < totals["stepping"] <= elapsed


def _dump(directory, steps):
    directory.mkdir(parents=True, exist_ok=True)
    for step, rows in steps.items():
        (directory / f"{step}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return directory


def _replay_drafts(*args):
    return subprocess.run([sys.executable, str(TOOLS / "replay_drafts.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_replay_drafts_from_step_past_the_last_dump_is_refused_in_one_line(tmp_path):
    """--from-step past the last dumped step left nothing to summarise and crashed in
    statistics.fmean (StatisticsError) after replaying every step."""
    resp = list(range(1, 9))
    dumps = _dump(tmp_path / "rollouts", {s: _rows(s, [resp, resp]) for s in (1, 2, 3)})
    out = _replay_drafts(dumps, "--from-step", 40)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert out.stderr.strip() == f"--from-step 40: the dumps in {dumps} end at step 3"
    assert out.stdout == ""                       # refused before the replay's first line
    # the last dumped step itself is a valid start
    ok = _replay_drafts(dumps, "--from-step", 3)
    assert ok.returncode == 0 and "summary from step 3" in ok.stdout and "window all" in ok.stdout


@pytest.mark.parametrize("flag,value,message", [
    ("--window", "-1", "--window '-1': expected non-negative integers"),      # deque(maxlen=-1): ValueError
    ("--window", "1,,2", "--window '1,,2': expected non-negative integers"),  # int(''): ValueError
    ("--draft-tokens", "0", "--draft-tokens 0: expected an integer >= 1"),    # the trees' max_depth check
    ("--token-budget", "0", "--token-budget 0: expected an integer >= 1"),    # ZeroDivisionError
    ("--min-prob", "2", "--min-prob 2.0: expected a probability in [0, 1]"),  # ran, drafting uncut
    ("--max-new-tokens", "0", "--max-new-tokens 0: expected an integer >= 1"),  # ran, drafting nothing
])
def test_replay_drafts_refuses_out_of_range_settings_before_any_work(tmp_path, flag, value, message):
    """The other settings of the same class: each crashed with a traceback deep in the replay, or ran
    a policy the engine cannot run (its config bounds: draft_tokens >= 1, draft_token_budget >= 1,
    0 <= draft_min_prob <= 1, max_new_tokens > 0)."""
    resp = list(range(1, 9))
    dumps = _dump(tmp_path / "rollouts", {s: _rows(s, [resp, resp]) for s in (1, 2)})
    out = _replay_drafts(dumps, flag, value)
    assert out.returncode != 0 and "Traceback" not in out.stderr and out.stdout == ""
    assert out.stderr.strip().startswith(message) and len(out.stderr.strip().splitlines()) == 1


def test_a_bad_step_cost_is_refused_before_any_work(tmp_path):
    import subprocess
    import sys

    tool = REPO_ROOT / "benchmarks" / "replay_drafts.py"
    out = subprocess.run([sys.executable, str(tool), str(tmp_path), "--step-cost", "8.4,0.18"],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "--step-cost '8.4,0.18': expected three numbers" in out.stderr


def test_a_bad_shared_nodes_is_refused_before_any_work(tmp_path):
    import subprocess
    import sys

    tool = REPO_ROOT / "benchmarks" / "replay_drafts.py"
    for bad in ("1e6", "1000,-1"):
        out = subprocess.run([sys.executable, str(tool), str(tmp_path / "absent"), "--shared-nodes", bad],
                             capture_output=True, text=True)
        assert out.returncode != 0 and f"--shared-nodes {bad!r}: expected non-negative integers" in out.stderr


def test_doctor_runs_its_learner_checks_on_cpu(tmp_path):
    """`megatron-specrl doctor` (once tools/gpu_check.py): on this CPU its learner checks run over gloo
    and must pass; the CUDA-only ones are skipped."""
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "megatron_specrl.cli", "doctor", "--small", "--out", str(out),
                           "--only", "learner_fp32,checkpoint,recompute,cuda_ipc"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["learner_fp32"]["ok"], r["learner_fp32"]
    assert r["learner_fp32"]["logprob_maxdiff_vs_hf"] < 1e-5 and r["learner_fp32"]["grad_maxdiff_vs_hf"] < 1e-5
    ck = r["checkpoint"]
    assert ck["ok"] and ck["weights_maxdiff"] == 0.0 and ck["resumed_step3_loss"] == ck["step3_loss"], ck
    if not torch.cuda.is_available():
        assert "skipped" in r["recompute"] and "skipped" in r["cuda_ipc"]
    assert "ALL OK" in proc.stdout


