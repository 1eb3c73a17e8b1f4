"""Acceptance rules on hand-made log-probs: u < prob accepts, anything else (NaN included) rejects.
"""

import math
import numpy as np
import pytest
from megatron_specrl.rollout.acceptance import Acceptance, accept_probabilities, count_nonfinite, decide

NAN, INF = float("nan"), float("inf")


def test_accept_only_when_u_is_below_the_probability():
    draft = [5, 6, 7]
    # exact: accept with p(y_t); p = 0.5 each, u = 0.4 < 0.5 accepts, u = 0.5 does not
    acc = decide(draft, [math.log(0.5)] * 3, [0.0] * 3, np.array([0.4, 0.5, 0.0]), "exact")
    assert (acc.num_accepted, acc.ban_token, acc.nonfinite) == (1, 6, 0)
    # a zero-probability token is rejected even with u == 0
    acc = decide(draft, [0.0, -INF, 0.0], [0.0] * 3, np.zeros(3), "exact")
    assert (acc.num_accepted, acc.ban_token) == (1, 6)
    # lenient: min(1, l p / q); with l = 1 and p = q every token has probability 1 and u < 1 always
    acc = decide(draft, [-1.0] * 3, [-1.0] * 3, np.array([0.999, 0.0, 0.5]), "lenient")
    assert acc == Acceptance(3, None, 0.0, 0)


@pytest.mark.parametrize("mode", ["exact", "lenient"])
def test_nonfinite_new_logprob_rejects_and_is_counted(mode):
    draft = [1, 2, 3, 4]
    p = [-0.1, NAN, -0.1, -0.1]
    acc = decide(draft, p, [-0.1] * 4, np.zeros(4), mode, lenience=2.0)
    assert acc.num_accepted == 1 and acc.nonfinite == 1          # u = 0 < NaN is False: reject
    assert np.isnan(accept_probabilities(np.array(p), np.full(4, -0.1), mode, 2.0)[1])
    # +inf is not a log-prob either: it would read as probability 1, it rejects
    acc = decide(draft, [-0.1, -0.1, INF, -0.1], [-0.1] * 4, np.zeros(4), mode, lenience=2.0)
    assert acc.num_accepted == 2 and acc.nonfinite == 1


def test_nonfinite_old_logprob_rejects_in_lenient_only():
    draft = [1, 2, 3]
    q = [-0.1, -INF, NAN]                      # q = -inf would make p / q infinite: accept anything
    lenient = decide(draft, [-0.1] * 3, q, np.zeros(3), "lenient", lenience=1.0)
    assert lenient.num_accepted == 1 and lenient.nonfinite == 2
    exact = decide(draft, [0.0] * 3, q, np.zeros(3), "exact")     # exact never reads q; still counted
    assert exact.num_accepted == 3 and exact.nonfinite == 2


@pytest.mark.parametrize("mode", ["exact", "lenient"])
def test_token_outside_the_nucleus_rejects_without_counting(mode):
    """Processed log-probs are -inf outside top-k / top-p: probability 0, not an engine error."""
    acc = decide([1, 2, 3], [-0.1, -INF, -0.1], [-0.1] * 3, np.zeros(3), mode, lenience=2.0)
    assert acc.num_accepted == 1 and acc.nonfinite == 0


def test_count_nonfinite():
    assert count_nonfinite([NAN, INF, -INF, -3.0], neg_inf_ok=True) == 2
    assert count_nonfinite([0.0, -1.5], np.array([-2.0])) == 0
    assert count_nonfinite([NAN, INF, -INF, -3.0]) == 3
    assert count_nonfinite([None, -1.0], None) == 1               # an engine's None log-prob counts
    assert count_nonfinite([-1.0, "x", [2.0]]) == 2               # non-numeric entries, never a crash
    assert count_nonfinite(np.full((2, 3), NAN)) == 6 and count_nonfinite(NAN) == 1
    with pytest.raises(TypeError, match="object"):
        count_nonfinite(object())
    assert decide([], [], [], np.zeros(0), "exact") == Acceptance(0, None, 0.0, 0)
