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

MODES = ("off", "exact", "lenient")


@dataclass
class Acceptance:
    num_accepted: int          # n: tokens y[:n] are kept
    ban_token: int | None      # token to exclude at position n when resampling (exact only)
    lenient_excess: float      # sum over accepted tokens of 1 - min(1, p/q): mass lenient over-accepts


def accept_probabilities(p_logprobs: np.ndarray, q_logprobs: np.ndarray, mode: str, lenience: float) -> np.ndarray:
    if mode == "exact":
        return np.exp(np.minimum(p_logprobs, 0.0))
    if mode == "lenient":
        return np.minimum(1.0, np.exp(math.log(lenience) + p_logprobs - q_logprobs))
    raise ValueError(f"no acceptance rule for spec_mode={mode!r}; choose one of {MODES}")


def decide(draft: list[int], p_logprobs: list[float], q_logprobs: list[float], uniforms: np.ndarray,
           mode: str, lenience: float = 1.0) -> Acceptance:
    """Accept token by token from the start until the first u_t > accept_prob_t."""
    if not draft:
        return Acceptance(0, None, 0.0)
    p = np.asarray(p_logprobs, dtype=np.float64)
    q = np.asarray(q_logprobs, dtype=np.float64)
    if not (len(p) == len(q) == len(draft) <= len(uniforms)):
        raise ValueError(f"draft of {len(draft)} tokens has {len(p)} new and {len(q)} old log-probs, "
                         f"{len(uniforms)} uniforms")
    probs = accept_probabilities(p, q, mode, lenience)
    rejected = np.nonzero(uniforms[: len(draft)] > probs)[0]
    n = int(rejected[0]) if len(rejected) else len(draft)
    excess = float(np.sum(1.0 - np.minimum(1.0, np.exp(p[:n] - q[:n])))) if mode == "lenient" else 0.0
    ban = draft[n] if (mode == "exact" and n < len(draft)) else None
    return Acceptance(n, ban, excess)
