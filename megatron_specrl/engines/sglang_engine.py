"""RolloutEngine over SGLang: `sglang.Engine` (in-process) or a running HTTP server.

SGLang cannot run on our CPU machines (its CPU path needs sgl_kernel, shipped
for CUDA only), so the request building, response parsing and update order are
pure functions tested on CPU against fake engines; GPU tests are marked `gpu`.

Semantics (read from sglang 0.5.23):
- `generate(input_ids=..., return_logprob=True)` -> `meta_info.output_token_logprobs`
  = [(logprob, token_id, text|None)], after temperature (SGLANG_RETURN_ORIGINAL_LOGPROB unset).
- Scoring = `logprob_start_len=len(prompt)-1`: `meta_info.input_token_logprobs` covers
  input ids from that index on, the first value None; input log-probs are untempered and
  untruncated, so score() supports temperature 1 without top-k / top-p only and returns no
  replacements (`verifies_processed_distribution = False`: SpeculativeRollout refuses other
  settings, and its exact rule falls back to ban_first_token, exact at temperature 1).
- A custom logit processor runs before the log-probs are taken, so the first token of a
  ban_first_token request is re-scored (one cached prefill) to report its unbanned log-prob.
- Weights: `update_weights_from_tensor(named_tensors, load_format, flush_cache=False)` per
  bucket, then one `flush_cache()` (radix cache) before the version is bumped.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Iterable

import torch

from megatron_specrl.engines.protocol import (
    EngineError, EngineHealth, GenerateRequest, GenerateResult, SamplingSettings, ScoreRequest,
    ScoreResult, WeightVersionMismatch, check_version,
)
from megatron_specrl.engines.logs import attach_log_file, detach_log_file, tail_lines

BAN_PARAM = "specrl_ban_first_token"


def ban_processor_str() -> str:
    """SGLang's serialized form (`CustomLogitProcessor.to_str()`) of the ban-first-token processor."""
    from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor

    class BanFirstToken(CustomLogitProcessor):
        def __call__(self, logits, custom_param_list=None):
            for i, params in enumerate(custom_param_list or []):
                tok = (params or {}).get(BAN_PARAM)
                req = (params or {}).get("__req__")
                if tok is not None and req is not None and len(req.output_ids) == 0:
                    logits[i, tok] = float("-inf")
            return logits

    return BanFirstToken.to_str()


# -- pure request / response functions -------------------------------------------------
def build_generate_payload(requests: list[GenerateRequest], sampling: SamplingSettings,
                           ban_processor: str | None = None) -> dict:
    """kwargs for `Engine.generate` (and the JSON body of POST /generate)."""
    params, procs = [], []
    for r in requests:
        p: dict[str, Any] = {"max_new_tokens": r.max_new_tokens, "temperature": sampling.temperature,
                             "top_p": sampling.top_p, "top_k": sampling.top_k}
        if r.seed is not None:
            p["sampling_seed"] = int(r.seed)
        if r.ban_first_token is not None:
            if ban_processor is None:
                raise ValueError("ban_first_token needs the custom logit processor string")
            p["custom_params"] = {BAN_PARAM: int(r.ban_first_token)}
        params.append(p)
        procs.append(ban_processor if r.ban_first_token is not None else None)
    payload = {"input_ids": [list(r.prompt_ids) for r in requests], "sampling_params": params,
               "return_logprob": True}
    if any(procs):
        payload["custom_logit_processor"] = procs
    return payload


def _finish_reason(meta: dict) -> str:
    fr = meta.get("finish_reason")
    kind = fr.get("type") if isinstance(fr, dict) else fr
    if kind in ("stop", "length"):
        return kind
    raise EngineError(f"request finished with {fr!r}", "sglang")


def _check_meta_version(meta: dict, expected: int | None) -> None:
    got = meta.get("weight_version")
    if expected is not None and got is not None and str(got) != str(expected):
        raise WeightVersionMismatch(f"sglang answered under weight version {got}, caller expects {expected}")


def parse_generate_response(outputs: list[dict], requests: list[GenerateRequest], weight_version: int,
                            meta_version: int | None = None) -> list[GenerateResult]:
    """`meta_version`: check meta_info.weight_version (set when the server's version is ours)."""
    if len(outputs) != len(requests):
        raise EngineError(f"{len(outputs)} outputs for {len(requests)} requests", "sglang")
    results = []
    for out in outputs:
        meta = out["meta_info"]
        _check_meta_version(meta, meta_version)
        lps = meta["output_token_logprobs"]
        toks = list(out.get("output_ids") or [t for _, t, *_ in lps])
        if [t for _, t, *_ in lps] != toks:
            raise EngineError("output_token_logprobs do not match output_ids", "sglang")
        results.append(GenerateResult(token_ids=toks, logprobs=[float(v) for v, *_ in lps],
                                      finish_reason=_finish_reason(meta),
                                      num_cached_tokens=int(meta.get("cached_tokens", 0)),
                                      weight_version=weight_version))
    return results


def build_score_payload(requests: list[ScoreRequest], sampling: SamplingSettings) -> dict:
    for setting, value, plain in (("temperature", sampling.temperature, 1.0), ("top_p", sampling.top_p, 1.0),
                                  ("top_k", sampling.top_k, -1)):
        if value != plain and not (setting == "top_k" and value == 0):
            raise NotImplementedError(f"SGLang engine: score() with {setting}={value} is not supported (input "
                                      "log-probs are untempered and untruncated); verification needs the vLLM engine")
    if any(not r.prompt_ids for r in requests):
        raise ValueError("score() needs a non-empty prompt")
    return {"input_ids": [list(r.prompt_ids) + list(r.continuation_ids) for r in requests],
            "sampling_params": [{"max_new_tokens": 1, "temperature": 1.0} for _ in requests],
            "return_logprob": True,
            "logprob_start_len": [len(r.prompt_ids) - 1 for r in requests]}


def parse_score_response(outputs: list[dict], requests: list[ScoreRequest], weight_version: int,
                         meta_version: int | None = None) -> list[ScoreResult]:
    results = []
    for out, r in zip(outputs, requests, strict=True):
        meta = out["meta_info"]
        _check_meta_version(meta, meta_version)
        n = len(r.continuation_ids)
        tail = meta["input_token_logprobs"][len(meta["input_token_logprobs"]) - n:] if n else []
        if [t for _, t, *_ in tail] != list(r.continuation_ids) or any(v is None for v, *_ in tail):
            raise EngineError("input_token_logprobs do not cover the continuation", "sglang")
        results.append(ScoreResult(logprobs=[float(v) for v, *_ in tail], weight_version=weight_version))
    return results


def _ok(ret) -> bool:
    """SGLang returns (success, message) tuples or objects with .success."""
    if isinstance(ret, tuple):
        return bool(ret[0])
    if isinstance(ret, dict):
        return bool(ret.get("success", True))
    return bool(getattr(ret, "success", ret if isinstance(ret, bool) else True))


# -- engines --------------------------------------------------------------------------
class _SGLangBase:
    """Version bookkeeping + the update order shared by the Engine and HTTP variants."""

    verifies_processed_distribution = False   # score(): temperature 1, no top-k / top-p, no replacements

    def __init__(self, name: str, log_dir: str | Path | None, use_ban_processor: bool = True):
        self.name = name
        self.log_path = Path(log_dir or "logs/engines") / f"{name}.log"
        self._log_handler = attach_log_file(self.log_path)
        self._log = logging.getLogger(f"megatron_specrl.engines.{name}")
        self._version, self._pending = 0, None
        self._ban_proc = ban_processor_str() if use_ban_processor else None

    # backend hooks
    def _generate_raw(self, payload: dict) -> list[dict]: raise NotImplementedError
    def _load_tensors(self, named: list[tuple[str, torch.Tensor]]) -> Any: raise NotImplementedError
    def _flush(self) -> Any: raise NotImplementedError
    def _set_server_version(self, version: int) -> None: pass

    @property
    def weight_version(self) -> int:
        return self._version

    def _check(self, expected: int) -> None:
        check_version(self.name, self._version, expected)
        if self._pending is not None:
            raise WeightVersionMismatch(f"engine {self.name}: update to {self._pending} is half-loaded")

    def _call(self, payload: dict) -> list[dict]:
        try:
            out = self._generate_raw(payload)
        except (EngineError, WeightVersionMismatch, NotImplementedError, ValueError):
            raise
        except Exception as e:
            raise EngineError(f"{type(e).__name__}: {e}", self.name, tail_lines(self.log_path)) from e
        return out if isinstance(out, list) else [out]

    def generate(self, requests: list[GenerateRequest], sampling: SamplingSettings,
                 weight_version: int) -> list[GenerateResult]:
        if not requests:
            return []
        self._check(weight_version)
        outs = self._call(build_generate_payload(requests, sampling, self._ban_proc))
        results = parse_generate_response(outs, requests, weight_version, self._meta_version())
        banned = [i for i, r in enumerate(requests) if r.ban_first_token is not None and results[i].token_ids]
        if banned:  # report the first token's log-prob under the unbanned policy
            fix = self.score([ScoreRequest(requests[i].prompt_ids, results[i].token_ids[:1]) for i in banned],
                             sampling, weight_version)
            for i, s in zip(banned, fix):
                results[i].logprobs[0] = s.logprobs[0]
        self._check(weight_version)
        return results

    def score(self, requests: list[ScoreRequest], sampling: SamplingSettings,
              weight_version: int) -> list[ScoreResult]:
        self._check(weight_version)
        todo = [i for i, r in enumerate(requests) if r.continuation_ids]
        results = [ScoreResult([], weight_version) for _ in requests]
        if todo:
            sub = [requests[i] for i in todo]
            outs = self._call(build_score_payload(sub, sampling))
            for i, r in zip(todo, parse_score_response(outs, sub, weight_version, self._meta_version())):
                results[i] = r
        self._check(weight_version)
        return results

    def _meta_version(self) -> int | None:
        return None

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        if version <= self._version:
            raise WeightVersionMismatch(f"engine {self.name}: update to {version}, serving {self._version}")
        self._pending = version
        named = list(named_tensors)
        if not _ok(self._load_tensors(named)):
            raise EngineError(f"update_weights_from_tensor failed for version {version}", self.name,
                              tail_lines(self.log_path))

    def finish_update(self, version: int) -> None:
        if self._pending not in (None, version):
            raise WeightVersionMismatch(f"finish_update({version}) but loaded {self._pending}")
        self.reset_prefix_cache()
        self._set_server_version(version)
        self._version, self._pending = version, None

    def reset_prefix_cache(self) -> None:
        if not _ok(self._flush()):
            raise EngineError("flush_cache failed (requests still running?)", self.name, tail_lines(self.log_path))

    def health(self) -> EngineHealth:
        return EngineHealth(alive=True, weight_version=self._version,
                            detail={"name": self.name, "pending_version": self._pending})

    def shutdown(self) -> None:
        detach_log_file(self._log_handler)


class SGLangEngine(_SGLangBase):
    """In-process `sglang.Engine` (GPU). `engine` may be injected (tests pass a fake)."""

    def __init__(self, model_path: str | None = None, name: str = "sglang-0", seed: int = 0,
                 max_model_len: int = 256, tensor_parallel_size: int = 1, dtype: str = "float32",
                 gpu_memory_utilization: float = 0.6, log_dir: str | Path | None = None,
                 engine: Any = None, use_ban_processor: bool = True, **engine_kwargs):
        super().__init__(name, log_dir, use_ban_processor)
        if engine is None:
            import sglang
            engine = sglang.Engine(model_path=str(model_path), random_seed=seed, context_length=max_model_len,
                                   tp_size=tensor_parallel_size, dtype=dtype,
                                   mem_fraction_static=gpu_memory_utilization,
                                   enable_custom_logit_processor=True, skip_tokenizer_init=True, **engine_kwargs)
        self.engine = engine

    def _generate_raw(self, payload):
        return self.engine.generate(**payload)

    def _load_tensors(self, named):
        return self.engine.update_weights_from_tensor(named_tensors=named, load_format=None, flush_cache=False)

    def _flush(self):
        return self.engine.flush_cache()

    def shutdown(self) -> None:
        try:
            self.engine.shutdown()
        finally:
            super().shutdown()


class SGLangHTTPEngine(_SGLangBase):
    """A running `python -m sglang.launch_server --enable-custom-logit-processor` server.
    Tensors go through /update_weights_from_tensor as IPC handles (colocated GPU only);
    the server's weight_version is set on each finish_update and checked on every answer."""

    def __init__(self, base_url: str, name: str = "sglang-http-0", log_dir: str | Path | None = None,
                 timeout_s: float = 600.0, use_ban_processor: bool = True, post=None):
        super().__init__(name, log_dir, use_ban_processor)
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._post = post or self._urllib_post
        self._set_server_version(0)   # the server starts at "default"; answers must carry ours

    def _urllib_post(self, path: str, body: dict) -> Any:
        import urllib.request
        req = urllib.request.Request(self.base_url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            text = resp.read().decode()
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return {"success": True, "message": text}

    def _meta_version(self) -> int | None:
        return self._version

    def _generate_raw(self, payload):
        return self._post("/generate", payload)

    def _load_tensors(self, named):
        from sglang.srt.utils import MultiprocessingSerializer
        blob = MultiprocessingSerializer.serialize(named, output_str=True)
        return self._post("/update_weights_from_tensor",
                          {"serialized_named_tensors": [blob], "flush_cache": False})

    def _flush(self):
        return self._post("/flush_cache", {})

    def _set_server_version(self, version: int) -> None:
        if not _ok(self._post("/update_weight_version", {"new_version": str(version)})):
            raise EngineError(f"update_weight_version({version}) failed", self.name, tail_lines(self.log_path))
