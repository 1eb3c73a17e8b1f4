"""A tiny GRPO run through the trainer with learner.distributed_optimizer=true at DP2 (Megatron's DDP and
distributed Adam on gloo), checkpointed, then resumed at another layout (TP2).
"""

import json
import os
import subprocess
import sys
import pytest
from tests.helpers.paths import REPO_ROOT

ROOT = REPO_ROOT


def _train(out, model_cache, steps, *extra):
    args = ["tiny-cpu-grpo", f"output_dir={out}", f"trainer.total_steps={steps}", "data.num_synthetic=16",
            "trainer.prompts_per_step=8", "rollout.n_samples=4", "trainer.eval_every=0", "data.num_eval=16",
            "trainer.checkpoint_every=2", "logging.wandb=false", "learner.distributed_optimizer=true",
            # no SFT warm-up (hundreds of steps): the untrained model scores 0 on every sample (zero advantages),
            # so the entropy bonus gives the step a gradient to reduce and apply; short responses, small KV cache
            "model.warmup_steps=0", "learner.loss.entropy_coef=0.01", "rollout.max_new_tokens=32",
            "rollout.kv_cache_gb=0.25", *extra]
    env = dict(os.environ, MEGATRON_SPECRL_CACHE=str(model_cache))
    return subprocess.run([sys.executable, "-m", "megatron_specrl.cli", "train", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_grpo_with_distributed_optimizer_dp2_then_resume_at_tp2(tmp_path):
    out, cache = tmp_path / "run", tmp_path / "model-cache"
    first = _train(out, cache, 2, "learner.dp=2")
    assert first.returncode == 0, first.stderr[-4000:]
    ckpt = out / "checkpoints" / "step_00000002"
    meta = json.loads(next(ckpt.rglob("specrl_learner.json")).read_text())
    assert (meta["dp"], meta["tp"], meta["distributed_optimizer"]) == (2, 1, True)
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["train/grad_norm"] > 0 and all(abs(r["train/loss"]) < 10 for r in rows)

    second = _train(out, cache, 3, "learner.tp=2")        # the same 2 processes, resharded DP2 -> TP2
    assert second.returncode == 0, second.stderr[-4000:]
    assert "resumed from" in second.stdout + second.stderr and "step_00000002" in second.stdout + second.stderr
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 3 and rows[-1]["weight_version"] == 3
    assert (out / "hf_final" / "model.safetensors").is_file()
