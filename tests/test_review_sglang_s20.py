"""Review of the SGLang engine after the vLLM engine's NaN / small-temperature fixes (CPU, fakes at
sglang.Engine's generate boundary).

- NaN / +inf log-probs: generate() refused none (vLLM's refuses them since 3793ab2). Reached the rollout
  directly, and through the ban_first_token re-score: score() passes a NaN verification row on (the
  acceptance rejects it), and the extension's banned request took its first log-prob from that row.
  Over HTTP SGLang's server writes NaN / inf as JSON null (orjson), which failed as a TypeError.
- Temperatures in (0, 1e-6): sglang 0.5.23's SamplingParams.__post_init__ turns them into greedy
  decoding at temperature 1 (`if 0 <= temperature < _SAMPLING_EPS: temperature = 1.0; top_k = 1`), so its
  log-probs were log_softmax(logits), not the learner's log_softmax(logits / T).
"""

import math

import pytest

from megatron_specrl.engines.protocol import EngineError, GenerateRequest, SamplingSettings
from megatron_specrl.engines.sglang_engine import SGLangEngine, SGLangHTTPEngine

T1 = SamplingSettings()


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


def make(fake):
    return SGLangEngine(engine=fake, max_model_len=64, use_ban_processor=False, name="sglang-s20",
                        log_dir="/tmp/specrl-sgl-s20")


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_generate_refuses_non_finite_logprobs(bad):
    eng = make(NaNSGLang([-1.0, bad]))
    with pytest.raises(EngineError, match="not finite") as e:
        eng.generate([GenerateRequest([1, 2], 2)], T1, 0)
    assert e.value.engine == "sglang-s20" and "token 11 at response position 1" in str(e.value)
    # -inf is a legitimate log-prob and stays
    assert make(NaNSGLang([-1.0, -math.inf])).generate([GenerateRequest([1, 2], 2)], T1, 0)[0].logprobs[1] == -math.inf


def test_banned_first_token_rescored_to_nan_is_refused():
    """The rejected position's NaN verification row came back as the extension's first log-prob."""
    eng = make(NaNSGLang([-1.0, -2.0], score_lp=math.nan))
    eng._ban_proc = "proc"
    with pytest.raises(EngineError, match="not finite"):
        eng.generate([GenerateRequest([1, 2], 2, ban_first_token=7)], T1, 0)
    eng = make(NaNSGLang([-1.0, -2.0], score_lp=-0.5))
    eng._ban_proc = "proc"
    assert eng.generate([GenerateRequest([1, 2], 2, ban_first_token=7)], T1, 0)[0].logprobs == [-0.5, -2.0]


def test_http_null_logprob_is_an_engine_error():
    """SGLang's HTTP server serializes with orjson, which writes NaN / inf as null."""
    def post(path, body):
        if path == "/update_weight_version":
            return {"success": True}
        return [{"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "length"}, "weight_version": "0",
                                                     "output_token_logprobs": [[-1.0, 5, None], [None, 6, None]]}}]

    eng = SGLangHTTPEngine("http://x:1", name="sglang-http-s20", post=post, use_ban_processor=False,
                           log_dir="/tmp/specrl-sgl-s20")
    with pytest.raises(EngineError, match="not finite"):
        eng.generate([GenerateRequest([1], 2)], T1, 0)


def test_temperature_sglang_would_make_greedy_is_refused():
    fake = NaNSGLang([-1.0])
    eng = make(fake)
    with pytest.raises(ValueError, match="_SAMPLING_EPS"):
        eng.generate([GenerateRequest([1], 1)], SamplingSettings(temperature=5e-7), 0)
    assert fake.calls == []
    # SGLang's bound is 1e-6, not vLLM's 0.01; 0 is plain greedy decoding; without log-probs nothing compares
    for t in (1e-6, 0.005, 0.0):
        eng.generate([GenerateRequest([1], 1)], SamplingSettings(temperature=t), 0)
    eng.generate([GenerateRequest([1], 1)], SamplingSettings(temperature=5e-7, need_logprobs=False), 0)
    assert [c["sampling_params"][0]["temperature"] for c in fake.calls] == [1e-6, 0.005, 0.0, 5e-7]
