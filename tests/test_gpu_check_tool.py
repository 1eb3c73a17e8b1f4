"""tools/gpu_check.py, the script a GPU lease runs, stays runnable: on this CPU its learner checks run
over gloo and must pass (the same checks found two GPU bugs on an H200 in session 28)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from test_review_bench_tools_s19 import _tool     # loads a tools/ script as a module

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
    mod = _tool("bench_verify_cost")
    dev = torch.device("cpu")
    model, cfg = mod.build("tiny", torch.float32, dev)
    assert next(model.parameters()).dtype == torch.float32 and torch.get_default_dtype() == torch.float32
    cache = mod.filled_cache(cfg, batch=3, context=16, dtype=torch.float32, device=dev)
    for q in (1, 4):
        assert mod.step_ms(model, cache, 3, 16, q, dev, repeats=1) > 0
    assert cache.get_seq_length() == 16


def test_plan_matches_the_recorded_h200_peaks(tmp_path):
    """The plan check's learner memory against the peaks measured on an H200 (session 28,
    docs/measurements_gpu/h200_s28_throughput.json; Megatron's local spec and torch's foreach AdamW, no
    TransformerEngine there). With full recompute the peak is the optimizer step's: torch's foreach AdamW
    holds an fp32 sqrt of every second moment, which the plan missed (10% low) until it counted it."""
    from transformers import LlamaConfig
    mod = _tool("gpu_check")
    rec = json.loads((ROOT / "docs" / "measurements_gpu" / "h200_s28_throughput.json").read_text())["throughput"]
    sh = rec["shape"]
    LlamaConfig(hidden_size=sh["hidden"], num_hidden_layers=sh["layers"], num_attention_heads=sh["heads"],
                num_key_value_heads=sh["kv"], intermediate_size=sh["inter"], vocab_size=sh["vocab"],
                max_position_embeddings=rec["T"]).save_pretrained(tmp_path)
    bf16 = {"precision": "bfloat16", "distributed_optimizer": True, "recompute_old_logprobs": True}
    plans = {tag: mod._plan_gib(tmp_path, rec["B"], rec["T"], kw) for tag, kw in (
        ("fp32", {}), ("bf16", bf16), ("bf16_recompute_selective", {**bf16, "recompute": "selective"}),
        ("bf16_recompute_full", {**bf16, "recompute": "full"}))}
    for tag, plan in plans.items():
        measured = rec[tag]["peak_train_gib"]
        assert abs(plan["total"] / measured - 1) < 0.05, (tag, plan, measured)
    # the step's temporaries set the full-recompute peak: without them the plan is 10% low there
    full = plans["bf16_recompute_full"]
    assert full["optimizer_step"] > full["activations"]
    assert (full["static"] + full["activations"]) / rec["bf16_recompute_full"]["peak_train_gib"] < 0.92


def test_adam_kind_follows_the_optimizer_the_learner_builds():
    """Replicated AdamW on GPUs is torch's foreach (an fp32 copy of the parameters in the step), the
    distributed optimizer on a GPU cluster TE's FusedAdam (none), CPU torch's per-tensor loop (one tensor)."""
    from megatron_specrl.config import load_config
    from megatron_specrl.plan import ModelShape, adam_kind, optimizer_step_bytes
    base = ROOT / "examples" / "tiny-cpu-grpo.yaml"
    assert adam_kind(load_config(base, [])) == "per_tensor"
    gpu = ["cluster.gpus_per_node=8"]
    assert adam_kind(load_config(base, gpu)) == "foreach"
    assert adam_kind(load_config(base, gpu + ["learner.distributed_optimizer=true"])) == "fused"
    s = ModelShape("llama", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=256, vocab=1000, tied=False,
                   qkv_bias=False, max_positions=128)
    assert optimizer_step_bytes(s, 1, 1024, 10_000, "foreach") == 40_000
    assert optimizer_step_bytes(s, 1, 1024, 10_000, "fused") == 0
    assert optimizer_step_bytes(s, 2, 1024, 10_000, "per_tensor") == 4 * 64 * 512   # the head's TP shard


def test_bench_verify_cost_fits_the_step_cost_replay_drafts_takes():
    """The GPU tool's fit over its (batch, q) grid recovers a known linear step cost, in the units
    tools/replay_drafts.py --step-cost takes (ms a step, a request, a draft token)."""
    import pytest
    mod = _tool("bench_verify_cost")
    a, b, c = 6.0, 0.02, 0.003
    rows = [{"batch": n, "ms": {q: a + b * n + c * n * (q - 1) for q in (1, 4, 8, 16)}} for n in (32, 128, 256)]
    assert mod.fit_step_cost(rows) == pytest.approx((a, b, c), rel=1e-6)
    with pytest.raises(ValueError, match="needs 10"):
        mod.fit_step_cost(rows[:2])
