"""SGLang's requests and answers as pure functions: our GenerateRequest / ScoreRequest as the JSON body of
SGLang's /generate (and `Engine.generate`'s keyword arguments), its answers read back into our results,
and the sampling settings SGLang would silently change, refused before a request reaches it. Pure, so
they are tested on CPU against fake engines (SGLang cannot run there).
"""

from __future__ import annotations

import math
from typing import Any

from megatron_specrl.engines.protocol import (
    ENGINE_KINDS, EngineError, GenerateRequest, GenerateResult, SamplingSettings, ScoreRequest, ScoreResult,
    WeightVersionMismatch, labels_with,
)
from megatron_specrl.rollout.tree_drafting.drafter import DRAFT_KEY, OWN_DRAFT, RESPONSE_START

BAN_PARAM = "specrl_ban_first_token"
SGLANG = ENGINE_KINDS["sglang"]   # what SGLang engines can do: the request builders below refuse the rest

# SGLang samples greedily at any temperature in [0, SGLANG_SAMPLING_EPS) (sglang 0.5.23,
# srt/sampling/sampling_params.py: `if 0 <= self.temperature < _SAMPLING_EPS: self.temperature = 1.0;
# self.top_k = 1`, silently) and reports log-probs at temperature 1 (the sampler's greedy branch:
# log_softmax(logits)); unlike vLLM (0.01) it tempers every temperature from 1e-6 on as asked
SGLANG_SAMPLING_EPS = 1e-6


def check_temperature(s: SamplingSettings, what: str) -> None:
    """Refuse a temperature SGLang would silently turn into greedy decoding at temperature 1: its
    log-probs would be log_softmax(logits), not the learner's log_softmax(logits / temperature)."""
    if 0 < s.temperature < SGLANG_SAMPLING_EPS:
        raise ValueError(f"{what}: temperature {s.temperature} is below SGLang's _SAMPLING_EPS, {SGLANG_SAMPLING_EPS}: "
                         "SGLang would decode greedily and report log-probs at temperature 1, not the learner's "
                         f"(log_softmax(logits / temperature)); use a temperature >= {SGLANG_SAMPLING_EPS}")


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


def build_generate_payload(requests: list[GenerateRequest], sampling: SamplingSettings,
                           ban_processor: str | None = None, draft: str = "none") -> dict:
    """kwargs for `Engine.generate` (and the JSON body of POST /generate). With draft="tree",
    requests with a draft key carry it and their response start in custom_params."""
    params, procs = [], []
    for r in requests:
        # no top-k is -1 or 0 here; SamplingParams.verify refuses 0 ("-1 (disable) or at least 1")
        p: dict[str, Any] = {"max_new_tokens": r.max_new_tokens, "temperature": sampling.temperature,
                             "top_p": sampling.top_p, "top_k": sampling.top_k if sampling.top_k > 0 else -1}
        if r.seed is not None:
            p["sampling_seed"] = int(r.seed)
        if r.runahead and not SGLANG.runs_ahead:
            raise NotImplementedError(f"run-ahead requests need the {labels_with('runs_ahead')} engine "
                                      "(rollout.runahead=0 with SGLang)")
        custom: dict[str, Any] = {}
        if r.ban_first_token is not None:
            if ban_processor is None:
                raise ValueError("ban_first_token needs the custom logit processor string")
            custom[BAN_PARAM] = int(r.ban_first_token)
        if r.own_draft is not None and (draft != "tree" or r.draft_key is None):
            raise ValueError("an own draft (rollout.verify=decode) needs tree drafting (rollout.draft=tree) and a "
                             "draft_key: the NGRAM worker's drafter drafts it")
        if r.draft_key is not None and draft == "tree":
            custom.update({DRAFT_KEY: str(r.draft_key), RESPONSE_START: int(r.response_start)})
            if r.own_draft:
                custom[OWN_DRAFT] = [int(t) for t in r.own_draft]
        if custom:
            p["custom_params"] = custom
        params.append(p)
        procs.append(ban_processor if r.ban_first_token is not None else None)
    payload = {"input_ids": [list(r.prompt_ids) for r in requests], "sampling_params": params,
               "return_logprob": True}
    if any(procs):
        payload["custom_logit_processor"] = procs
    return payload


def _finish_reason(meta: dict, engine: str = "sglang") -> str:
    fr = meta.get("finish_reason")
    kind = fr.get("type") if isinstance(fr, dict) else fr
    if kind in ("stop", "length"):
        return kind
    raise EngineError(f"request finished with {fr!r}", engine)


def _check_meta_version(meta: dict, expected: int | None, engine: str = "sglang") -> None:
    got = meta.get("weight_version")
    if expected is not None and got is not None and str(got) != str(expected):
        raise WeightVersionMismatch(f"engine {engine} answered under weight version {got}, caller expects {expected}")


def parse_generate_response(outputs: list[dict], requests: list[GenerateRequest], weight_version: int,
                            meta_version: int | None = None, engine: str = "sglang") -> list[GenerateResult]:
    """`meta_version`: check meta_info.weight_version (set when the server's version is ours).
    `engine`: the name errors carry."""
    if len(outputs) != len(requests):
        raise EngineError(f"{len(outputs)} outputs for {len(requests)} requests", engine)
    results = []
    for out in outputs:
        meta = out["meta_info"]
        _check_meta_version(meta, meta_version, engine)
        lps = meta["output_token_logprobs"]
        toks = list(out.get("output_ids") or [t for _, t, *_ in lps])
        if [t for _, t, *_ in lps] != toks:
            raise EngineError("output_token_logprobs do not match output_ids", engine)
        results.append(GenerateResult(token_ids=toks, logprobs=[None if v is None else float(v) for v, *_ in lps],
                                      finish_reason=_finish_reason(meta, engine),
                                      num_cached_tokens=int(meta.get("cached_tokens", 0)),
                                      weight_version=weight_version))
    return results


def build_score_payload(requests: list[ScoreRequest], sampling: SamplingSettings, engine: str = "sglang") -> dict:
    for setting, value, plain in (("temperature", sampling.temperature, 1.0), ("top_p", sampling.top_p, 1.0),
                                  ("top_k", sampling.top_k, -1)):
        if value != plain and not (setting == "top_k" and value == 0):
            raise NotImplementedError(f"SGLang engine {engine}: score() with {setting}={value} is not supported "
                                      "(input log-probs are untempered and untruncated); verification needs the "
                                      f"{labels_with('verifies_processed_distribution')} engine")
    if any(not r.prompt_ids for r in requests):
        raise ValueError("score() needs a non-empty prompt")
    return {"input_ids": [list(r.prompt_ids) + list(r.continuation_ids) for r in requests],
            "sampling_params": [{"max_new_tokens": 1, "temperature": 1.0} for _ in requests],
            "return_logprob": True,
            "logprob_start_len": [len(r.prompt_ids) - 1 for r in requests]}


def _same_ids(got: list[int], want: list[int], vocab_size: int | None) -> bool:
    """sglang 0.5.23 reports the input token id vocab_size - 1 as 0 in input_token_logprobs (its clip of
    image-token hashes, `x if x < vocab_size - 1 else 0`, srt/managers/scheduler_components/
    logprob_result_processor.py); the log-prob itself is the token's. A 0 stands for that id (for any id
    where the vocabulary size is unknown)."""
    return len(got) == len(want) and all(
        g == w or (g == 0 and (vocab_size is None or w == vocab_size - 1)) for g, w in zip(got, want))


def parse_score_response(outputs: list[dict], requests: list[ScoreRequest], weight_version: int,
                         meta_version: int | None = None, engine: str = "sglang",
                         vocab_size: int | None = None) -> list[ScoreResult]:
    results = []
    for out, r in zip(outputs, requests, strict=True):
        meta = out["meta_info"]
        _check_meta_version(meta, meta_version, engine)
        n = len(r.continuation_ids)
        tail = meta["input_token_logprobs"][len(meta["input_token_logprobs"]) - n:] if n else []
        if not _same_ids([t for _, t, *_ in tail], list(r.continuation_ids), vocab_size):
            raise EngineError(f"input_token_logprobs ({len(meta['input_token_logprobs'])} of an input of "
                              f"{len(r.prompt_ids) + n}, {meta.get('cached_tokens')} cached) do not cover the "
                              f"continuation ({n} tokens): ids {[t for _, t, *_ in tail][:16]}, continuation "
                              f"{list(r.continuation_ids)[:16]}", engine)
        # A NaN log-prob arrives over HTTP as JSON null: NaN again, as the vLLM engine returns it, so the
        # acceptance rejects the draft there and counts it (spec/nonfinite_logprobs) instead of the whole
        # score batch failing on one row
        results.append(ScoreResult(logprobs=[math.nan if v is None else float(v) for v, *_ in tail],
                                   weight_version=weight_version, num_cached_tokens=int(meta.get("cached_tokens") or 0)))
    return results


def message_of(ret) -> str:
    """SGLang's message in a (success, message) tuple or an object / dict with .message."""
    if isinstance(ret, tuple) and len(ret) > 1:
        return str(ret[1])
    if isinstance(ret, dict):
        return str(ret.get("message", ret))
    return str(getattr(ret, "message", ret))


def succeeded(ret) -> bool:
    """SGLang returns (success, message) tuples or objects with .success."""
    if isinstance(ret, tuple):
        return bool(ret[0])
    if isinstance(ret, dict):
        return bool(ret.get("success", True))
    return bool(getattr(ret, "success", ret if isinstance(ret, bool) else True))
