"""SGLang score(): a NaN log-prob (JSON null over HTTP) in one row no longer fails the whole score
batch; it comes back as NaN, as the vLLM engine's does, and the acceptance rejects the draft there and
counts it, while the other rows verify as usual."""

import math

import numpy as np
import pytest

from megatron_specrl.engines.protocol import EngineError, ScoreRequest
from megatron_specrl.engines.sglang_engine import parse_score_response
from megatron_specrl.rollout.acceptance import decide
from test_sglang_engine import score_out


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
