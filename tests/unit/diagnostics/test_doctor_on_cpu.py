"""`megatron-specrl doctor` on a machine without CUDA: the stack check runs (imports only), the
checks that need CUDA are reported as skipped with the reason, and the run passes. The learner
checks that run on CPU over gloo: tests/integration (they initialise torch.distributed)."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_specrl.cli import main
from megatron_specrl.diagnostics.doctor import ALL, CHECKS, doctor_main

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU behaviour: these checks run on a GPU")


def test_doctor_reports_the_cuda_checks_as_skipped_with_the_reason(tmp_path, capsys):
    out = tmp_path / "doctor.json"
    assert main(["doctor", "--only", "stack,recompute,cuda_ipc", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "stack: ok" in text
    assert "recompute: SKIPPED (learner.recompute=selective|full needs CUDA; torch sees no GPU)" in text
    assert "cuda_ipc: SKIPPED (CUDA IPC needs a CUDA GPU; torch sees none)" in text
    assert text.rstrip().endswith("ALL OK (2 skipped: recompute, cuda_ipc)")
    record = json.loads(out.read_text())
    assert record["device"] == "cpu" and record["cuda"] is None
    assert record["stack"]["ok"] and record["stack"]["gpus"] == 0 and "imports only" in record["stack"]["note"]
    assert any(line.startswith("torch==") for line in record["stack"]["installed"])
    assert "needs CUDA" in record["recompute"]["skipped"] and "CUDA" in record["cuda_ipc"]["skipped"]


def test_doctor_fails_the_stack_check_when_a_gpu_is_required(tmp_path, capsys):
    """--gpus 1 on a CPU node: the stack check names the missing GPU (and, for the CPU wheels, the
    versions off the GPU pins), exits 4 and runs no smoke check."""
    out = tmp_path / "doctor.json"
    assert doctor_main(["--gpus", "1", "--only", "stack,learner_fp32", "--out", str(out)]) == 4
    text = capsys.readouterr().out
    assert "stack: FAILED" in text and "smoke checks did not run" in text
    record = json.loads(out.read_text())
    assert any("--gpus=1: CUDA sees 0 GPU(s)" in f for f in record["stack"]["failures"])
    assert "learner_fp32" not in record


def test_doctor_refuses_an_unknown_check(tmp_path, capsys):
    assert doctor_main(["--only", "stack,warp_drive", "--out", str(tmp_path / "d.json")]) == 2
    assert "unknown check(s) warp_drive" in capsys.readouterr().err
    assert ALL[0] == "stack" and set(ALL[1:]) == set(CHECKS)
