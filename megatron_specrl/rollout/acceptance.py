"""Acceptance rules for reusing an old response y as a draft under the new policy.

`exact`   treats y as a point-mass draft: token t is accepted with probability
          p(y_t) (speculative sampling with q = delta_y), and the first rejected
          position is resampled from p with y_n excluded. Every rollout is then
          an exact sample of the current policy.
`lenient` is SPEC-RL's rule: accept with probability min(1, l * p(y_t) / q(y_t)),
          l >= 1, and resample the rejected position from the full p. Faster,
          but biased toward the old policy even at l = 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MODES = ("off", "exact", "lenient", "coupled")


@dataclass
class Acceptance:
    num_accepted: int          # n: tokens y[:n] are kept
    ban_token: int | None      # token to exclude at position n when resampling (exact only)
    lenient_excess: float      # sum over accepted tokens of 1 - min(1, p/q): mass lenient over-accepts
    # Invalid entries among the draft's log-probs: NaN or +inf in either, -inf in the old ones (a sampled
    # token had positive probability). An engine error, never accepted past. -inf in the new ones is
    # not counted: under top-k / top-p it is a token outside the nucleus, probability 0. The caller
    # logs the step's sum as `spec/nonfinite_logprobs`.
    nonfinite: int = 0


def _is_finite_number(v) -> bool:
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def _is_neg_inf(v) -> bool:
    try:
        return float(v) == -math.inf
    except (TypeError, ValueError):
        return False


def count_nonfinite(*logprobs, neg_inf_ok: bool = False) -> int:
    """Number of entries of the given log-prob sequences that are not finite numbers (NaN, +-inf,
    None or anything non-numeric an engine might return); with `neg_inf_ok`, -inf (probability 0)
    is fine. A None sequence counts 0 and a bare number counts as one entry; an object that is
    neither raises TypeError naming its type."""
    total = 0
    for values in logprobs:
        if values is None:
            continue
        try:
            arr = np.asarray(values, dtype=np.float64)
        except (TypeError, ValueError):   # ragged or non-numeric entries: one by one
            try:
                total += sum(not (_is_finite_number(v) or (neg_inf_ok and _is_neg_inf(v))) for v in values)
            except TypeError:
                raise TypeError(f"count_nonfinite needs sequences of log-probs, "
                                f"got {type(values).__name__}") from None
            continue
        ok = np.isfinite(arr) | (np.isneginf(arr) if neg_inf_ok else False)
        total += int(arr.size - np.count_nonzero(ok))
    return total


def accept_probabilities(p_logprobs: np.ndarray, q_logprobs: np.ndarray, mode: str, lenience: float) -> np.ndarray:
    """Per-token acceptance probability; NaN where an input the rule reads is not finite (rejected)."""
    with np.errstate(over="ignore", invalid="ignore"):
        # p = -inf is a token outside the nucleus: probability 0, rejected like any u >= 0
        p_bad = np.isnan(p_logprobs) | np.isposinf(p_logprobs)
        if mode == "exact":
            probs = np.exp(np.minimum(p_logprobs, 0.0))
            bad = p_bad
        elif mode == "lenient":
            probs = np.minimum(1.0, np.exp(math.log(lenience) + p_logprobs - q_logprobs))
            bad = p_bad | ~np.isfinite(q_logprobs)
        else:
            raise ValueError(f"no acceptance rule for spec_mode={mode!r}; choose one of {MODES}")
    return np.where(bad, np.nan, probs)


def coupled_prefix(draft: list[int], coupled_draws: list[int], p_logprobs: list[float]) -> Acceptance:
    """spec_mode=coupled: the draft survives up to the first position where the coupled draw under
    the new weights (the same noise the draft was drawn with, megatron_specrl.rollout.coupled)
    differs from it; there the coupled draw is the new token. No randomness here: the result is
    what generation with that noise gives, whatever the draft. A non-finite new log-prob ends the
    prefix there and is counted."""
    p = np.asarray(p_logprobs, dtype=np.float64)
    if not (len(draft) == len(coupled_draws) == len(p)):
        raise ValueError(f"draft of {len(draft)} tokens has {len(coupled_draws)} coupled draws and {len(p)} log-probs")
    bad = ~(np.asarray(draft) == np.asarray(coupled_draws)) | np.isnan(p) | (p == np.inf)
    stop = np.nonzero(bad)[0]
    return Acceptance(int(stop[0]) if len(stop) else len(draft), None, 0.0, count_nonfinite(p, neg_inf_ok=True))


def decide(draft: list[int], p_logprobs: list[float], q_logprobs: list[float], uniforms: np.ndarray,
           mode: str, lenience: float = 1.0) -> Acceptance:
    """Accept token by token from the start while u_t < accept_prob_t; stop at the first token where not.

    `not (u < prob)` rejects a NaN probability (a non-finite log-prob from the engine) and a token of
    probability 0 even when u == 0; `nonfinite` counts those non-finite log-probs.
    """
    if not draft:
        return Acceptance(0, None, 0.0)
    p = np.asarray(p_logprobs, dtype=np.float64)
    q = np.asarray(q_logprobs, dtype=np.float64)
    if not (len(p) == len(q) == len(draft) <= len(uniforms)):
        raise ValueError(f"draft of {len(draft)} tokens has {len(p)} new and {len(q)} old log-probs, "
                         f"{len(uniforms)} uniforms")
    probs = accept_probabilities(p, q, mode, lenience)
    rejected = np.nonzero(~(np.asarray(uniforms[: len(draft)]) < probs))[0]
    n = int(rejected[0]) if len(rejected) else len(draft)
    excess = float(np.sum(1.0 - np.minimum(1.0, np.exp(p[:n] - q[:n])))) if mode == "lenient" else 0.0
    ban = draft[n] if (mode == "exact" and n < len(draft)) else None
    return Acceptance(n, ban, excess, count_nonfinite(p, neg_inf_ok=True) + count_nonfinite(q))
