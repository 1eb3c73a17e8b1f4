"""SGLang engine at the API boundary (CPU, fake Engine / HTTP) + a GPU integration test.

SGLang cannot start on CPU (sgl_kernel is CUDA-only), so these tests check what we
send (input_ids, sampling params, logprob_start_len, the ban processor) and how we
read answers (meta_info logprobs, finish reasons, weight versions) and the
update -> flush -> version order.
"""

import pytest
import torch

from megatron_specrl.engines.protocol import (
    EngineError, GenerateRequest, SamplingSettings, ScoreRequest, WeightVersionMismatch,
)
from megatron_specrl.engines.sglang_engine import (
    BAN_PARAM, SGLangEngine, SGLangHTTPEngine, build_generate_payload, build_score_payload,
    parse_generate_response, parse_score_response,
)

T1 = SamplingSettings()
PROC = "<ban-processor>"


def gen_out(tokens, lps, reason="length", cached=0, version=None):
    meta = {"finish_reason": {"type": reason}, "cached_tokens": cached,
            "output_token_logprobs": [(lp, t, None) for lp, t in zip(lps, tokens)]}
    if version is not None:
        meta["weight_version"] = str(version)
    return {"output_ids": list(tokens), "meta_info": meta}


def score_out(input_ids, start, lps, version=None):
    """SGLang: ids from logprob_start_len on, values shifted with a leading None."""
    ids = input_ids[start:]
    meta = {"finish_reason": {"type": "length"}, "output_token_logprobs": [(-1.0, 7, None)],
            "input_token_logprobs": [(v, t, None) for v, t in zip([None] + lps, ids)]}
    if version is not None:
        meta["weight_version"] = str(version)
    return {"output_ids": [7], "meta_info": meta}


class FakeSGLang:
    """Records calls in order; answers like sglang.Engine."""

    def __init__(self):
        self.calls = []

    def generate(self, **kw):
        # what sglang.Engine.generate / SamplingParams.verify refuse (sglang 0.5.23)
        assert set(kw) <= {"input_ids", "sampling_params", "return_logprob", "logprob_start_len",
                           "top_logprobs_num", "token_ids_logprob", "custom_logit_processor", "rid", "stream"}, kw
        for p in kw["sampling_params"]:
            if p.get("top_k", -1) != -1 and p.get("top_k", -1) < 1:
                raise ValueError(f"top_k must be -1 (disable) or at least 1, got {p['top_k']}.")
        self.calls.append(("generate", kw))
        if "logprob_start_len" in kw:
            return [score_out(ids, s, [-0.5] * (len(ids) - s - 1))
                    for ids, s in zip(kw["input_ids"], kw["logprob_start_len"])]
        return [gen_out([10 + i, 11], [-2.0, -3.0]) for i in range(len(kw["input_ids"]))]

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append(("update", [n for n, _ in named_tensors], flush_cache))
        return True, "ok"

    def flush_cache(self):
        self.calls.append(("flush",))
        return type("R", (), {"success": True})()

    def shutdown(self):
        self.calls.append(("shutdown",))


def make(fake=None):
    return SGLangEngine(engine=fake or FakeSGLang(), use_ban_processor=False, log_dir="/tmp/specrl-sgl-test")


def test_generate_payload():
    reqs = [GenerateRequest([1, 2, 3], 5, seed=7), GenerateRequest([4], 2, ban_first_token=9)]
    p = build_generate_payload(reqs, SamplingSettings(0.8, 0.9, 20), ban_processor=PROC)
    assert p["input_ids"] == [[1, 2, 3], [4]] and p["return_logprob"] is True
    assert p["sampling_params"][0] == {"max_new_tokens": 5, "temperature": 0.8, "top_p": 0.9, "top_k": 20,
                                       "sampling_seed": 7}
    assert p["sampling_params"][1]["custom_params"] == {BAN_PARAM: 9}
    assert p["custom_logit_processor"] == [None, PROC]
    assert "custom_logit_processor" not in build_generate_payload(reqs[:1], T1)
    with pytest.raises(ValueError):
        build_generate_payload(reqs, T1, ban_processor=None)


def test_parse_generate_response():
    reqs = [GenerateRequest([1], 2), GenerateRequest([2], 2)]
    res = parse_generate_response([gen_out([5, 6], [-1.0, -2.0], "stop", cached=32), gen_out([7, 8], [-3., -4.])],
                                  reqs, weight_version=3)
    assert res[0].token_ids == [5, 6] and res[0].logprobs == [-1.0, -2.0] and res[0].finish_reason == "stop"
    assert res[0].num_cached_tokens == 32 and res[1].finish_reason == "length" and res[1].weight_version == 3
    with pytest.raises(EngineError):
        parse_generate_response([gen_out([5], [-1.0], "abort")], reqs[:1], 0)
    with pytest.raises(WeightVersionMismatch):   # answered under another server version
        parse_generate_response([gen_out([5], [-1.0], version=2)], reqs[:1], 3, meta_version=3)


def test_score_payload_and_parse():
    reqs = [ScoreRequest([1, 2, 3], [4, 5]), ScoreRequest([6], [7])]
    p = build_score_payload(reqs, T1)
    assert p["input_ids"] == [[1, 2, 3, 4, 5], [6, 7]] and p["logprob_start_len"] == [2, 0]
    assert p["return_logprob"] is True
    outs = [score_out(p["input_ids"][0], 2, [-0.1, -0.2]), score_out(p["input_ids"][1], 0, [-0.3])]
    res = parse_score_response(outs, reqs, weight_version=1)
    assert [r.logprobs for r in res] == [[-0.1, -0.2], [-0.3]]
    with pytest.raises(NotImplementedError):
        build_score_payload(reqs, SamplingSettings(temperature=0.6))
    with pytest.raises(EngineError):   # response not covering the continuation
        parse_score_response([score_out([1, 2, 3, 9, 5], 2, [-0.1, -0.2])], reqs[:1], 1)


@pytest.mark.parametrize("setting, sampling", [("temperature", SamplingSettings(temperature=0.7)),
                                               ("top_p", SamplingSettings(top_p=0.9)),
                                               ("top_k", SamplingSettings(top_k=20))])
def test_score_refuses_what_it_cannot_verify(setting, sampling):
    """Input log-probs are untempered and untruncated: score() names the setting, sends nothing,
    and SpeculativeRollout refuses the same settings for exact and lenient before any request."""
    from megatron_specrl.rollout.speculative import SpeculativeRollout
    from megatron_specrl.rollout.store import TrajectoryStore

    fake = FakeSGLang()
    eng = make(fake)
    with pytest.raises(NotImplementedError, match=f"{setting}="):
        eng.score([ScoreRequest([1, 2], [3])], sampling, 0)
    for mode in ("exact", "lenient"):
        with pytest.raises(NotImplementedError, match="cannot verify"):
            SpeculativeRollout(eng, TrajectoryStore(), mode=mode, lenience=1.0, sampling=sampling,
                               max_new_tokens=4, seed=0)
    assert fake.calls == [] and not eng.verifies_processed_distribution
    SpeculativeRollout(eng, TrajectoryStore(), mode="off", lenience=1.0, sampling=sampling, max_new_tokens=4, seed=0)
    assert eng.score([ScoreRequest([1, 2], [3])], SamplingSettings(top_k=0), 0)[0].replacements is None


def test_engine_generate_rescores_banned_first_token():
    fake = FakeSGLang()
    eng = make(fake)
    eng._ban_proc = PROC
    out = eng.generate([GenerateRequest([1, 2], 2, ban_first_token=10), GenerateRequest([3], 2)], T1, 0)
    kinds = [c[0] for c in fake.calls]
    assert kinds == ["generate", "generate"]
    score_call = fake.calls[1][1]
    assert score_call["input_ids"] == [[1, 2, 10]] and score_call["logprob_start_len"] == [1]
    assert out[0].logprobs == [-0.5, -3.0] and out[1].logprobs == [-2.0, -3.0]


def test_update_then_flush_then_version():
    fake = FakeSGLang()
    eng = make(fake)
    eng.update_weights([("a", torch.zeros(1))], 1)
    eng.update_weights([("b", torch.zeros(1))], 1)
    with pytest.raises(WeightVersionMismatch):          # half-loaded weights are never served
        eng.generate([GenerateRequest([1], 1)], T1, 0)
    assert eng.weight_version == 0
    eng.finish_update(1)
    assert fake.calls == [("update", ["a"], False), ("update", ["b"], False), ("flush",)]
    assert eng.weight_version == 1
    with pytest.raises(WeightVersionMismatch):
        eng.generate([GenerateRequest([1], 1)], T1, 0)
    with pytest.raises(WeightVersionMismatch):
        eng.update_weights([("a", torch.zeros(1))], 1)


def test_failed_flush_keeps_old_version():
    fake = FakeSGLang()
    fake.flush_cache = lambda: (False, "requests running")
    eng = make(fake)
    eng.update_weights([("a", torch.zeros(1))], 1)
    with pytest.raises(EngineError, match="flush_cache"):
        eng.finish_update(1)
    assert eng.weight_version == 0


def test_http_engine_sets_and_checks_server_version():
    posts, server = [], {"version": "default"}

    def post(path, body):
        posts.append(path)
        if path == "/update_weight_version":
            server["version"] = body["new_version"]
            return {"success": True}
        if path == "/flush_cache":
            return {"success": True, "message": "Cache flushed."}
        if path == "/generate":
            return [gen_out([5], [-1.0], version=server["version"]) for _ in body["input_ids"]]
        raise AssertionError(path)

    eng = SGLangHTTPEngine("http://x:1", post=post, use_ban_processor=False, log_dir="/tmp/specrl-sgl-test")
    assert posts == ["/update_weight_version"] and server["version"] == "0"
    assert eng.generate([GenerateRequest([1], 1)], T1, 0)[0].token_ids == [5]
    server["version"] = "9"                               # someone else changed the server
    with pytest.raises(WeightVersionMismatch):
        eng.generate([GenerateRequest([1], 1)], T1, 0)
    server["version"] = "0"
    eng.finish_update(1)
    assert posts[-2:] == ["/flush_cache", "/update_weight_version"] and server["version"] == "1"


def _sglang_gpu_available():
    try:
        import sglang  # noqa: F401
        return torch.cuda.is_available()
    except Exception:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _sglang_gpu_available(), reason="needs CUDA and sglang")
def test_sglang_gpu_integration(tiny_llama):
    """On a GPU box: sampling log-probs == scoring log-probs, ban holds, update + flush."""
    eng = SGLangEngine(str(tiny_llama), name="sglang-gpu", log_dir="/tmp/specrl-sgl-test")
    try:
        prompt = list(range(5, 60))
        g = eng.generate([GenerateRequest(prompt, 16, seed=0)], T1, 0)[0]
        s = eng.score([ScoreRequest(prompt, g.token_ids)], T1, 0)[0]
        assert max(abs(a - b) for a, b in zip(g.logprobs, s.logprobs)) < 1e-3
        b = eng.generate([GenerateRequest(prompt, 4, seed=0, ban_first_token=g.token_ids[0])], T1, 0)[0]
        assert b.token_ids[0] != g.token_ids[0]
        from safetensors.torch import load_file
        w = load_file(str(tiny_llama / "model.safetensors"))
        eng.update_weights([(k, (v * 1.1).cuda()) for k, v in w.items()], 1)
        eng.finish_update(1)
        g2 = eng.generate([GenerateRequest(prompt, 4, seed=0)], T1, 1)[0]
        assert g2.num_cached_tokens == 0
    finally:
        eng.shutdown()
