"""A test double of the engine protocol with an enumerable tabular policy.

The statistical tests need the exact probability of every possible response,
which no neural engine gives; this engine's policy is a fixed function of the
context, so the whole response distribution can be enumerated.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

from megatron_specrl.engines.protocol import (EngineHealth, GenerateRequest, GenerateResult, SamplingSettings,
                                              ScoreRequest, ScoreResult, check_version)

EOS = 0


class TabularPolicy:
    """p(token | context) = softmax(scale * base logits + drift * update logits); vocab 0..V-1, EOS = 0.

    Base logits are shared by every policy; `update_seed` and `drift` model a train step."""

    def __init__(self, vocab: int, update_seed: int = 0, drift: float = 0.0, scale: float = 2.5):
        self.vocab, self.update_seed, self.drift, self.scale = vocab, update_seed, drift, scale

    @staticmethod
    def _noise(key, size: int) -> np.ndarray:
        h = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
        return np.random.default_rng(int.from_bytes(h, "little")).normal(size=size)

    def probs(self, context: tuple[int, ...]) -> np.ndarray:
        logits = self.scale * self._noise(("base", context), self.vocab) \
            + self.drift * self._noise(("update", self.update_seed, context), self.vocab)
        e = np.exp(logits - logits.max())
        return e / e.sum()

    def sequence_distribution(self, prompt: tuple[int, ...], max_len: int) -> dict[tuple[int, ...], float]:
        """Exact probability of every response (ends at EOS or at max_len)."""
        out: dict[tuple[int, ...], float] = {}

        def walk(resp: tuple[int, ...], prob: float):
            if (resp and resp[-1] == EOS) or len(resp) == max_len:
                out[resp] = prob
                return
            ps = self.probs(prompt + resp)
            for tok in range(self.vocab):
                walk(resp + (tok,), prob * ps[tok])

        walk((), 1.0)
        return out


class TabularEngine:
    name = "tabular"

    def __init__(self, policy: TabularPolicy, version: int = 0):
        self.policy, self._version = policy, version
        self.calls: list[str] = []

    @property
    def weight_version(self) -> int:
        return self._version

    def generate(self, requests: list[GenerateRequest], sampling: SamplingSettings, weight_version: int):
        check_version(self.name, self._version, weight_version)
        self.calls.append("generate")
        results = []
        for r in requests:
            rng = np.random.default_rng(r.seed)
            ctx, toks, lps = tuple(r.prompt_ids), [], []
            finish = "length"
            for i in range(r.max_new_tokens):
                p = self.policy.probs(ctx)
                draw = p.copy()
                if i == 0 and r.ban_first_token is not None:
                    draw[r.ban_first_token] = 0.0
                draw /= draw.sum()
                tok = int(rng.choice(len(draw), p=draw))
                toks.append(tok)
                lps.append(math.log(p[tok]))     # log-prob under the unbanned policy
                ctx = ctx + (tok,)
                if tok == EOS:
                    finish = "stop"
                    break
            results.append(GenerateResult(toks, lps, finish, 0, self._version))
        return results

    def score(self, requests: list[ScoreRequest], sampling: SamplingSettings, weight_version: int):
        check_version(self.name, self._version, weight_version)
        self.calls.append("score")
        out = []
        for r in requests:
            ctx, lps = tuple(r.prompt_ids), []
            for tok in r.continuation_ids:
                lps.append(math.log(self.policy.probs(ctx)[tok]))
                ctx = ctx + (tok,)
            out.append(ScoreResult(lps, self._version))
        return out

    def set_policy(self, policy: TabularPolicy, version: int) -> None:
        self.policy, self._version = policy, version

    def health(self):
        return EngineHealth(True, self._version)

