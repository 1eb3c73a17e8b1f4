"""bench-rollout's bookkeeping: epochs from step rows, the steady-state summary, a real smoke run."""

import json

import pytest

from megatron_specrl.bench_rollout import bench_rollout_main, per_epoch, summarize


def _row(step, rollout_s, acc, gen, reward=0.5, **extra):
    return {"step": step, "spec/rollout_s": rollout_s, "spec/accepted_tokens": acc,
            "spec/generated_tokens": gen, "reward/mean": reward, "response/mean_len": 10.0, **extra}


def test_per_epoch_groups_steps_and_picks_the_epoch_end_eval():
    rows = [{"step": 0, "eval/accuracy": 0.25}]          # the step-0 eval row has no rollout
    rows += [_row(s, 1.0, 0, 100) for s in (1, 2)] + [_row(s, 0.5, 60, 40, **({"eval/accuracy": 0.5} if s == 4 else {}))
                                                      for s in (3, 4)]
    eps = per_epoch(rows, steps_per_epoch=2)
    assert [e["epoch"] for e in eps] == [1, 2]
    assert eps[0]["rollout_s"] == 2.0 and eps[0]["reuse_ratio"] == 0.0 and eps[0]["eval_accuracy"] is None
    assert eps[1]["rollout_s"] == 1.0 and eps[1]["reuse_ratio"] == pytest.approx(0.6)
    assert eps[1]["eval_accuracy"] == 0.5


def test_summary_counts_only_steady_epochs():
    off = [{"epoch": e, "rollout_s": 4.0, "accepted_tokens": 0, "generated_tokens": 100, "reward": 0.4,
            "eval_accuracy": 0.3} for e in range(1, 5)]
    fast = [{"epoch": e, "rollout_s": 4.0 if e < 3 else 1.0, "accepted_tokens": 0 if e < 3 else 90,
             "generated_tokens": 100 if e < 3 else 10, "reward": 0.4, "eval_accuracy": 0.35} for e in range(1, 5)]
    s = summarize({"off": off, "lenient": fast})
    assert s["speedup_lenient"] == pytest.approx(4.0)       # epochs 1-2 (slow) are not counted
    assert s["reuse_ratio_lenient"] == pytest.approx(0.9)
    assert s["final_eval_accuracy_lenient"] == 0.35


@pytest.mark.slow
def test_bench_smoke_run_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    rc = bench_rollout_main(["--recipe", "tiny-cpu-grpo", "--modes", "off,lenient", "--epochs", "3",
                             "--prompts", "4", "--prompts-per-step", "4", "--eval-prompts", "8",
                             "--output-dir", str(tmp_path / "runs"), "--json", str(out),
                             "model.warmup_steps=0", "rollout.n_samples=4", "rollout.max_new_tokens=16",
                             "learner.micro_batch_size=16"])
    assert rc == 0
    data = json.loads(out.read_text())
    assert set(data["epochs"]) == {"off", "lenient"} and len(data["epochs"]["lenient"]) == 3
    assert data["summary"]["reuse_ratio_off"] == 0.0
    assert 0.0 < data["summary"]["reuse_ratio_lenient"] <= 1.0     # drafts exist from epoch 2
    assert data["summary"]["speedup_lenient"] > 0
    assert all(e["eval_accuracy"] is not None for e in data["epochs"]["off"])
