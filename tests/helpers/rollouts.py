"""Small stand-ins for a tokenizer and a rollout sample."""

from __future__ import annotations

from megatron_specrl.rollout.speculative import RolloutSample


class Tok:
    def decode(self, ids):
        return " ".join(f"t{i}" for i in ids)


def _sample(pid, k, resp, reused=0):
    return RolloutSample(pid, k, [1, 2], resp, [-0.5] * len(resp), "stop", reused, 3)


