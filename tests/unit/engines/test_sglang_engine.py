"""SGLang engine at the API boundary (CPU, fake Engine / HTTP): pure plumbing.

The engine's behaviour against a real sglang 0.5.23 engine on the CPU (generation, log-probs and the
weight update against HF transformers, the radix cache under a speculative rollout) is
tests/integration/engines/test_sglang_engine.py. These tests check what we send (input_ids, sampling
params, logprob_start_len, the ban processor) and how we read answers (meta_info logprobs, finish
reasons, weight versions), the order of the weight-update calls and the error paths a real engine
does not reach on demand (refusals, HTTP errors, NaN, colocated memory calls).

Review of the SGLang engine against sglang 0.5.23's real API (CPU, a strict fake Engine).

`StrictSGLang` rejects what sglang.Engine rejects, read from its source:
- Engine.generate's keyword names (srt/entrypoints/engine.py) and SamplingParams' fields;
- SamplingParams.verify (srt/sampling/sampling_params.py): "top_k must be -1 (disable) or at least 1",
  top_p in (0, 1], temperature >= 0;
- TokenizerManager._validate_one_request (srt/managers/tokenizer_manager.py): "The input (...) is longer
  than the model's context length" when len(input_ids) >= context_len, and "Requested token count
  exceeds the model's maximum context length" when len(input_ids) + max_new_tokens > context_len
  (validate_total_tokens = True, allow_auto_truncate off);
both raised as ValueError out of Engine.generate.

Review of the SGLang engine after the vLLM engine's NaN / small-temperature fixes (CPU, fakes at
sglang.Engine's generate boundary).

- NaN / +inf log-probs: generate() refused none (vLLM's refuses them since 3793ab2). Reached the rollout
  directly, and through the ban_first_token re-score: score() passes a NaN verification row on (the
  acceptance rejects it), and the extension's banned request took its first log-prob from that row.
  Over HTTP SGLang's server writes NaN / inf as JSON null (orjson), which failed as a TypeError.
- Temperatures in (0, 1e-6): sglang 0.5.23's SamplingParams.__post_init__ turns them into greedy
  decoding at temperature 1 (`if 0 <= temperature < _SAMPLING_EPS: temperature = 1.0; top_k = 1`), so its
  log-probs were log_softmax(logits), not the learner's log_softmax(logits / T).

SGLang score(): a NaN log-prob (JSON null over HTTP) in one row no longer fails the whole score
batch; it comes back as NaN, as the vLLM engine's does, and the acceptance rejects the draft there and
counts it, while the other rows verify as usual.
"""

import pytest
import torch
from megatron_specrl.engines.protocol import (
    EngineError, GenerateRequest, SamplingSettings, ScoreRequest, WeightVersionMismatch,
)
from megatron_specrl.engines.sglang import (
    BAN_PARAM, SGLangEngine, SGLangHTTPEngine, build_generate_payload, build_score_payload,
    parse_generate_response, parse_score_response,
)
from tests.helpers.sglang import FakeSGLang, WeightUpdateWindow, gen_out, score_out  # noqa: F401
import io
import urllib.error
import urllib.request
import math
import numpy as np
from megatron_specrl.rollout.acceptance import decide



# ---- SGLang engine at the API boundary (CPU, fake Engine / HTTP) + a GPU integration test.

T1 = SamplingSettings()
PROC = "<ban-processor>"






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


def test_buckets_load_inside_one_weight_update_window():
    """Plumbing (the real engine: tests/integration/engines/test_sglang_engine.py): one begin before the
    first bucket, one end and one flush at finish_update; a refused load leaves the window open and the
    version pending, so the update can be sent again."""
    fake = FakeSGLang()
    eng = make(fake)
    eng.update_weights([("a", torch.zeros(1))], 1)
    eng.update_weights([("b", torch.zeros(1))], 1)
    eng.finish_update(1)
    assert fake.calls == [("begin",), ("update", ["a"], False), ("update", ["b"], False), ("end",), ("flush",)]
    fake.calls.clear()
    fake.update_weights_from_tensor = lambda **kw: (False, "Failed to update parameter online: shape")
    with pytest.raises(EngineError, match="update_weights_from_tensor.*shape"):
        eng.update_weights([("a", torch.zeros(1))], 2)
    assert fake.calls == [("begin",)] and eng.weight_version == 1
    del fake.update_weights_from_tensor
    eng.update_weights([("a", torch.zeros(1))], 2)
    eng.finish_update(2)
    assert fake.calls[1:] == [("update", ["a"], False), ("end",), ("flush",)] and eng.weight_version == 2


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
        if path in ("/flush_cache", "/begin_weight_update", "/end_weight_update"):
            return {"success": True, "message": "Success"}
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
    eng._load_tensors = lambda named: posts.append("/update_weights_from_tensor") or {"success": True}
    eng.update_weights([("a", torch.zeros(1))], 1)
    eng.finish_update(1)
    assert posts[-5:] == ["/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update",
                          "/flush_cache", "/update_weight_version"] and server["version"] == "1"






# ---- Review of the SGLang engine against sglang 0.5.23's real API (CPU, a strict fake Engine).

GENERATE_KWARGS = {
    "prompt", "sampling_params", "input_ids", "image_data", "audio_data", "video_data", "mm_hashes",
    "mm_content_hashes", "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob",
    "lora_path", "custom_logit_processor", "require_reasoning", "return_hidden_states",
    "return_routed_experts", "routed_experts_start_len", "stream", "bootstrap_host", "bootstrap_port",
    "bootstrap_room", "routed_dp_rank", "disagg_prefill_dp_rank", "kv_hints", "data_parallel_rank",
    "external_trace_header", "rid", "session_params", "priority", "session_id", "cache_salt",
}
SAMPLING_FIELDS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "beam_width",
    "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed",
    "custom_params", "watermark",
}


class StrictSGLang(WeightUpdateWindow):
    """sglang.Engine(skip_tokenizer_init=True) at its generate boundary, with its validation."""

    def __init__(self, context_len=64):
        self.context_len, self.calls = context_len, []

    def generate(self, **kw):
        unknown = set(kw) - GENERATE_KWARGS
        if unknown:
            raise TypeError(f"generate() got unexpected keyword arguments {sorted(unknown)}")
        self.calls.append(kw)
        ids, params = kw["input_ids"], kw["sampling_params"]
        assert isinstance(ids[0], list) and len(params) == len(ids)
        starts = kw.get("logprob_start_len")
        outs = []
        for i, (x, p) in enumerate(zip(ids, params)):
            assert set(p) <= SAMPLING_FIELDS, set(p) - SAMPLING_FIELDS
            temperature, top_p, top_k = p.get("temperature", 1.0), p.get("top_p", 1.0), p.get("top_k", -1)
            if 0 <= temperature < 1e-6:
                top_k = 1
            if top_k == -1:
                top_k = 1 << 30
            if temperature < 0:
                raise ValueError(f"temperature must be a non-negative finite number, got {temperature}.")
            if not 0.0 < top_p <= 1.0:
                raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
            if top_k < 1:
                raise ValueError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
            if len(x) >= self.context_len:
                raise ValueError(f"The input ({len(x)} tokens) is longer than the model's context length "
                                 f"({self.context_len} tokens).")
            if len(x) + p.get("max_new_tokens", 128) > self.context_len:
                raise ValueError("Requested token count exceeds the model's maximum context length")
            n = min(p.get("max_new_tokens", 128), 2)
            toks = [10 + t for t in range(n)]
            meta = {"id": str(i), "finish_reason": {"type": "length", "length": n}, "prompt_tokens": len(x),
                    "weight_version": "default", "cached_tokens": 0, "completion_tokens": n,
                    "output_token_logprobs": [(-1.0 - t, tok, None) for t, tok in enumerate(toks)]}
            if starts is not None:
                s = starts[i]
                meta["input_token_logprobs"] = [(None, x[s], None)] + [(-0.25 * (j + 1), t, None)
                                                                         for j, t in enumerate(x[s + 1:])]
            outs.append({"output_ids": toks, "meta_info": meta})
        return outs

    def flush_cache(self):
        return type("FlushCacheReqOutput", (), {"success": True, "message": ""})()


def _make_strict(context_len=64, **kw):
    return SGLangEngine(engine=StrictSGLang(context_len), max_model_len=context_len, use_ban_processor=False,
                        log_dir="/tmp/specrl-sgl-review", name="sglang-7", **kw)


def test_no_top_k_reaches_sglang_as_minus_one():
    """top_k 0 is "no top-k" in this project (protocol.untruncated_t1, config's truncated = top_k > 0);
    SGLang's SamplingParams.verify rejects 0."""
    eng = _make_strict()
    out = eng.generate([GenerateRequest([1, 2, 3], 2)], SamplingSettings(top_k=0), 0)
    assert out[0].token_ids == [10, 11]
    assert eng.engine.calls[0]["sampling_params"][0]["top_k"] == -1
    eng.generate([GenerateRequest([1, 2, 3], 2)], SamplingSettings(top_k=5), 0)
    assert eng.engine.calls[1]["sampling_params"][0]["top_k"] == 5


def test_score_at_the_last_position_verifies_a_prefix():
    """protocol.score: a continuation reaching the engine's last position is verified up to the token
    before it. SGLang refuses an input of context_len tokens or more (and input + max_new_tokens over
    it), which would fail the whole batch."""
    eng = _make_strict(context_len=8)
    res = eng.score([ScoreRequest([1, 2, 3, 4, 5], [6, 7, 8]), ScoreRequest([1, 2], [3, 4]),
                     ScoreRequest([1, 2, 3, 4, 5, 6, 7], [8])], T1, 0)
    assert [len(r.logprobs) for r in res] == [2, 2, 0]
    assert res[0].logprobs == [-0.25, -0.5] and res[1].logprobs == [-0.25, -0.5]
    assert eng.engine.calls[0]["input_ids"] == [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4]]


def test_errors_name_the_engine():
    eng = _make_strict()
    eng.engine.generate = lambda **kw: [{"output_ids": [5], "meta_info": {
        "finish_reason": {"type": "abort", "message": "x"}, "output_token_logprobs": [(-1.0, 5, None)]}}]
    with pytest.raises(EngineError) as e:
        eng.generate([GenerateRequest([1], 1)], T1, 0)
    assert e.value.engine == "sglang-7"
    eng.engine.generate = lambda **kw: [{"output_ids": [5], "meta_info": {
        "finish_reason": {"type": "length"}, "output_token_logprobs": [(-1.0, 6, None)]}}]
    with pytest.raises(EngineError) as e:
        eng.generate([GenerateRequest([1], 1)], T1, 0)
    assert e.value.engine == "sglang-7"
    eng.engine.generate = lambda **kw: [{"output_ids": [5], "meta_info": {
        "finish_reason": {"type": "length"}, "output_token_logprobs": [(-1.0, 5, None)],
        "input_token_logprobs": [(None, 1, None), (-1.0, 9, None)]}}]
    with pytest.raises(EngineError) as e:
        eng.score([ScoreRequest([1], [2])], T1, 0)
    assert e.value.engine == "sglang-7"
    eng.engine = StrictSGLang(64)   # SGLang's own ValueError (a request it refuses) says which engine
    with pytest.raises(ValueError, match="sglang-7"):
        eng.generate([GenerateRequest([1], 1)], SamplingSettings(top_p=1.5), 0)
    with pytest.raises(NotImplementedError, match="sglang-7"):
        eng.score([ScoreRequest([1], [2])], SamplingSettings(top_p=0.9), 0)


def test_http_version_mismatch_names_the_engine():
    def post(path, body):
        if path == "/generate":
            return [{"output_ids": [5], "meta_info": {"finish_reason": {"type": "length"}, "weight_version": "9",
                                                      "output_token_logprobs": [(-1.0, 5, None)]}}]
        return {"success": True}
    eng = SGLangHTTPEngine("http://x:1", name="sglang-http-3", post=post, use_ban_processor=False,
                           log_dir="/tmp/specrl-sgl-review")
    with pytest.raises(WeightVersionMismatch, match="sglang-http-3"):
        eng.generate([GenerateRequest([1], 1)], T1, 0)


def test_http_control_call_failures_are_engine_errors(monkeypatch):
    """SGLang's /flush_cache answers a refused flush with HTTP 400 (text body), and
    /update_weights_from_tensor a failed load with 400 and {"success": false, ...}: urlopen raises
    HTTPError for both, which must become the engine's EngineError (the version stays)."""
    answers = {"/update_weight_version": (200, b'{"success": true, "message": "ok"}'),
               "/begin_weight_update": (200, b'{"success": true, "message": "Success"}'),
               "/end_weight_update": (200, b'{"success": true, "message": "Success"}'),
               "/update_weights_from_tensor": (200, b'{"success": true, "message": "ok"}'),
               "/flush_cache": (400, b"Flush cache failed.\n")}

    class Resp(io.BytesIO):
        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    def urlopen(req, timeout=None):
        path = req.full_url.split(":1", 1)[1]
        code, body = answers[path]
        if code != 200:
            raise urllib.error.HTTPError(req.full_url, code, "Bad Request", {}, io.BytesIO(body))
        return Resp(body)

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    eng = SGLangHTTPEngine("http://x:1", name="sglang-http-4", use_ban_processor=False,
                           log_dir="/tmp/specrl-sgl-review")
    eng._load_tensors = lambda named: {"success": True}   # (MultiprocessingSerializer needs sglang)
    eng.update_weights([("a", torch.zeros(1))], 1)
    with pytest.raises(EngineError) as e:
        eng.finish_update(1)
    assert e.value.engine == "sglang-http-4" and eng.weight_version == 0
    answers["/update_weight_version"] = (400, b'{"success": false, "message": "Failed to update weight version"}')
    answers["/flush_cache"] = (200, b"Cache flushed.\n")
    with pytest.raises(EngineError) as e:
        eng.finish_update(1)
    assert e.value.engine == "sglang-http-4" and eng.weight_version == 0


class MemorySGLang(StrictSGLang):
    """Engine.release_memory_occupation / resume_memory_occupation(tags=None), as the scheduler's
    weight_updater keeps them: None = every type (weights, kv_cache, cuda_graph); resuming a tag that
    was not released is a KeyError (offload_tags.remove)."""

    ALL = ("kv_cache", "weights", "cuda_graph")

    def __init__(self):
        super().__init__()
        self.offloaded = set()

    def release_memory_occupation(self, tags=None):
        self.offloaded.update(tags or self.ALL)

    def resume_memory_occupation(self, tags=None):
        for t in tags or self.ALL:
            self.offloaded.remove(t)


def test_colocated_engine_sleeps_and_wakes_like_vllm():
    """resync.lifecycle / trainer call release_memory() before the learner's step, then
    resume_memory(["weights"]) and, after finish_update, resume_memory(["kv_cache"]) (rollout.colocate
    on GPUs, the default): every memory type SGLang released must be back after the two calls."""
    eng = SGLangEngine(engine=MemorySGLang(), use_ban_processor=False, log_dir="/tmp/specrl-sgl-review",
                       name="sglang-9")
    eng.release_memory()
    assert eng.engine.offloaded
    eng.resume_memory(["weights"])
    eng.update_weights([("a", torch.zeros(1))], 1)
    eng.finish_update(1)
    eng.resume_memory(["kv_cache"])
    assert eng.engine.offloaded == set()
    eng.release_memory()
    eng.resume_memory()
    assert eng.engine.offloaded == set()
    eng.engine.release_memory_occupation = lambda tags=None: (_ for _ in ()).throw(RuntimeError("not idle"))
    with pytest.raises(EngineError) as e:
        eng.release_memory()
    assert e.value.engine == "sglang-9"


# ---- Review of the SGLang engine after the vLLM engine's NaN / small-temperature fixes (CPU, fakes at

class NaNSGLang:
    """sglang.Engine(skip_tokenizer_init=True).generate: tokens 10, 11, ... with `gen_lps`; scoring
    requests (logprob_start_len) get `score_lp` for every input token after the start."""

    def __init__(self, gen_lps, score_lp=-0.5):
        self.gen_lps, self.score_lp, self.calls = gen_lps, score_lp, []

    def generate(self, **kw):
        self.calls.append(kw)
        starts, outs = kw.get("logprob_start_len"), []
        for i, (x, p) in enumerate(zip(kw["input_ids"], kw["sampling_params"])):
            n = min(p["max_new_tokens"], len(self.gen_lps))
            toks = [10 + t for t in range(n)]
            meta = {"finish_reason": {"type": "length"}, "cached_tokens": 0,
                    "output_token_logprobs": [(self.gen_lps[t], tok, None) for t, tok in enumerate(toks)]}
            if starts is not None:
                s = starts[i]
                meta["input_token_logprobs"] = [(None, x[s], None)] + [(self.score_lp, t, None) for t in x[s + 1:]]
            outs.append({"output_ids": toks, "meta_info": meta})
        return outs


def _make_checked(fake):
    return SGLangEngine(engine=fake, max_model_len=64, use_ban_processor=False, name="sglang-nan",
                        log_dir="/tmp/specrl-sgl-nan")


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_generate_refuses_non_finite_logprobs(bad):
    eng = _make_checked(NaNSGLang([-1.0, bad]))
    with pytest.raises(EngineError, match="not finite") as e:
        eng.generate([GenerateRequest([1, 2], 2)], T1, 0)
    assert e.value.engine == "sglang-nan" and "token 11 at response position 1" in str(e.value)
    # -inf is a legitimate log-prob and stays
    assert _make_checked(NaNSGLang([-1.0, -math.inf])).generate([GenerateRequest([1, 2], 2)], T1, 0)[0].logprobs[1] == -math.inf


def test_banned_first_token_rescored_to_nan_is_refused():
    """The rejected position's NaN verification row came back as the extension's first log-prob."""
    eng = _make_checked(NaNSGLang([-1.0, -2.0], score_lp=math.nan))
    eng._ban_proc = "proc"
    with pytest.raises(EngineError, match="not finite"):
        eng.generate([GenerateRequest([1, 2], 2, ban_first_token=7)], T1, 0)
    eng = _make_checked(NaNSGLang([-1.0, -2.0], score_lp=-0.5))
    eng._ban_proc = "proc"
    assert eng.generate([GenerateRequest([1, 2], 2, ban_first_token=7)], T1, 0)[0].logprobs == [-0.5, -2.0]


def test_http_null_logprob_is_an_engine_error():
    """SGLang's HTTP server serializes with orjson, which writes NaN / inf as null."""
    def post(path, body):
        if path == "/update_weight_version":
            return {"success": True}
        return [{"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "length"}, "weight_version": "0",
                                                     "output_token_logprobs": [[-1.0, 5, None], [None, 6, None]]}}]

    eng = SGLangHTTPEngine("http://x:1", name="sglang-http-nan", post=post, use_ban_processor=False,
                           log_dir="/tmp/specrl-sgl-nan")
    with pytest.raises(EngineError, match="not finite"):
        eng.generate([GenerateRequest([1], 2)], T1, 0)


def test_temperature_sglang_would_make_greedy_is_refused():
    fake = NaNSGLang([-1.0])
    eng = _make_checked(fake)
    with pytest.raises(ValueError, match="_SAMPLING_EPS"):
        eng.generate([GenerateRequest([1], 1)], SamplingSettings(temperature=5e-7), 0)
    assert fake.calls == []
    # SGLang's bound is 1e-6, not vLLM's 0.01; 0 is plain greedy decoding; without log-probs nothing compares
    for t in (1e-6, 0.005, 0.0):
        eng.generate([GenerateRequest([1], 1)], SamplingSettings(temperature=t), 0)
    eng.generate([GenerateRequest([1], 1)], SamplingSettings(temperature=5e-7, need_logprobs=False), 0)
    assert [c["sampling_params"][0]["temperature"] for c in fake.calls] == [1e-6, 0.005, 0.0, 5e-7]


# ---- SGLang score(): a NaN log-prob (JSON null over HTTP) in one row no longer fails the whole score

def test_null_logprob_is_nan_in_its_row_only():
    reqs = [ScoreRequest([1, 2, 3], [4, 5, 6]), ScoreRequest([7, 8], [9])]
    outs = [score_out([1, 2, 3, 4, 5, 6], 2, [-0.1, None, -0.3]), score_out([7, 8, 9], 1, [-0.4])]
    res = parse_score_response(outs, reqs, weight_version=3)
    assert res[0].logprobs[0] == -0.1 and math.isnan(res[0].logprobs[1]) and res[0].logprobs[2] == -0.3
    assert res[1].logprobs == [-0.4] and {r.weight_version for r in res} == {3}

    acc = decide([4, 5, 6], res[0].logprobs, [-0.1, -0.2, -0.3], np.zeros(3), "exact")
    assert acc.num_accepted == 1 and acc.nonfinite == 1      # rejected at the NaN, counted
    with pytest.raises(EngineError, match="do not cover the continuation"):   # other tokens: still an error
        parse_score_response([score_out([1, 2, 3, 4, 9, 6], 2, [-0.1, -0.2, -0.3])], reqs[:1], 3)


def test_tree_drafting_is_refused_on_cpu_before_sglang_starts(monkeypatch):
    """SGLang's NGRAM verification needs CUDA kernels and verifies greedily on CPU: one line, nothing started."""
    import os
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="rollout.draft=tree with rollout.engine=sglang needs a GPU: SGLang.s NGRAM"):
        SGLangEngine("/nonexistent", draft="tree", log_dir="/tmp/specrl-sgl-test")
    assert "SGLANG_USE_CPU_ENGINE" not in os.environ
