"""tools/gpu_check.py, the script a GPU lease runs, stays runnable: on this CPU its learner checks run
over gloo and must pass (the same checks found two GPU bugs on an H200 in session 28)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_runs_its_learner_checks_on_cpu(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--small", "--out", str(out),
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


def test_bench_verify_cost_runs_and_restores_the_cache():
    """tools/bench_verify_cost.py (prepared for a GPU lease): a forward over q new tokens per sequence
    on a filled KV cache, cropped back each time (the tool asserts the cache length), on the tiny shape."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_verify_cost", ROOT / "tools" / "bench_verify_cost.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    dev = torch.device("cpu")
    model, cfg = mod.build("tiny", torch.float32, dev)
    assert next(model.parameters()).dtype == torch.float32 and torch.get_default_dtype() == torch.float32
    cache = mod.filled_cache(cfg, batch=3, context=16, dtype=torch.float32, device=dev)
    for q in (1, 4):
        assert mod.step_ms(model, cache, 3, 16, q, dev, repeats=1) > 0
    assert cache.get_seq_length() == 16
