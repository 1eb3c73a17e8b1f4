"""Review of the SGLang engine against sglang 0.5.23's real API (CPU, a strict fake Engine).

`StrictSGLang` rejects what sglang.Engine rejects, read from its source:
- Engine.generate's keyword names (srt/entrypoints/engine.py) and SamplingParams' fields;
- SamplingParams.verify (srt/sampling/sampling_params.py): "top_k must be -1 (disable) or at least 1",
  top_p in (0, 1], temperature >= 0;
- TokenizerManager._validate_one_request (srt/managers/tokenizer_manager.py): "The input (...) is longer
  than the model's context length" when len(input_ids) >= context_len, and "Requested token count
  exceeds the model's maximum context length" when len(input_ids) + max_new_tokens > context_len
  (validate_total_tokens = True, allow_auto_truncate off);
both raised as ValueError out of Engine.generate.
"""

import io
import urllib.error
import urllib.request

import pytest
import torch

from megatron_specrl.engines.protocol import (
    EngineError, GenerateRequest, SamplingSettings, ScoreRequest, WeightVersionMismatch,
)
from megatron_specrl.engines.sglang_engine import SGLangEngine, SGLangHTTPEngine

T1 = SamplingSettings()

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


class StrictSGLang:
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

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        return True, "Succeeded to update model weights."


def make(context_len=64, **kw):
    return SGLangEngine(engine=StrictSGLang(context_len), max_model_len=context_len, use_ban_processor=False,
                        log_dir="/tmp/specrl-sgl-review", name="sglang-7", **kw)


def test_no_top_k_reaches_sglang_as_minus_one():
    """top_k 0 is "no top-k" in this project (protocol.untruncated_t1, config's truncated = top_k > 0);
    SGLang's SamplingParams.verify rejects 0."""
    eng = make()
    out = eng.generate([GenerateRequest([1, 2, 3], 2)], SamplingSettings(top_k=0), 0)
    assert out[0].token_ids == [10, 11]
    assert eng.engine.calls[0]["sampling_params"][0]["top_k"] == -1
    eng.generate([GenerateRequest([1, 2, 3], 2)], SamplingSettings(top_k=5), 0)
    assert eng.engine.calls[1]["sampling_params"][0]["top_k"] == 5


def test_score_at_the_last_position_verifies_a_prefix():
    """protocol.score: a continuation reaching the engine's last position is verified up to the token
    before it. SGLang refuses an input of context_len tokens or more (and input + max_new_tokens over
    it), which would fail the whole batch."""
    eng = make(context_len=8)
    res = eng.score([ScoreRequest([1, 2, 3, 4, 5], [6, 7, 8]), ScoreRequest([1, 2], [3, 4]),
                     ScoreRequest([1, 2, 3, 4, 5, 6, 7], [8])], T1, 0)
    assert [len(r.logprobs) for r in res] == [2, 2, 0]
    assert res[0].logprobs == [-0.25, -0.5] and res[1].logprobs == [-0.25, -0.5]
    assert eng.engine.calls[0]["input_ids"] == [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4]]


def test_errors_name_the_engine():
    eng = make()
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
