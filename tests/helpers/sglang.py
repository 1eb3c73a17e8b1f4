"""A strict fake of sglang 0.5.23's Engine and its score output, for the SGLang engine's API-boundary tests."""

from __future__ import annotations



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


class WeightUpdateWindow:
    """sglang 0.5.23's weight-update window (srt/managers/scheduler_components/weight_updater.py):
    update_weights_from_tensor is refused outside begin_weight_update() ... end_weight_update(), and a
    window opens once. The real engine's behaviour is tested in tests/integration/engines/test_sglang_engine.py;
    fakes with it test plumbing (call order, error paths)."""

    calls: list
    _window = False

    def begin_weight_update(self, selector="all"):
        self.calls.append(("begin",))
        if self._window:
            return False, "begin_weight_update() twice: call end_weight_update() first"
        self._window = True
        return True, "Success"

    def end_weight_update(self):
        self.calls.append(("end",))
        if not self._window:
            return False, "end_weight_update() without begin_weight_update()"
        self._window = False
        return True, "Success"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append(("update", [n for n, _ in named_tensors], flush_cache))
        if not self._window:
            return False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
        return True, "Succeeded to update model weights."


class FakeSGLang(WeightUpdateWindow):
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

    def flush_cache(self):
        self.calls.append(("flush",))
        return type("R", (), {"success": True})()

    def shutdown(self):
        self.calls.append(("shutdown",))


