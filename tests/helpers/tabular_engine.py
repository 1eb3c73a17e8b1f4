"""A test double of the engine protocol with an enumerable tabular policy.

The statistical tests need the exact probability of every possible response,
which no neural engine gives; this engine's policy is a fixed function of the
context, so the whole response distribution can be enumerated. It samples and
verifies under the processed distribution (temperature, then vLLM's top-k / top-p
rule) as the vLLM engine does, with replacements, unless built with
`replacements=False` (then it scores like SGLang: temperature 1 only, no
replacements, and honours ban_first_token). With replacements it also samples coupled
(`coupled_seed`: the position-keyed Gumbel noise of megatron_specrl.rollout.coupled), as the
vLLM engine's patch does.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch

from megatron_specrl.engines.protocol import (EngineCapabilities, EngineHealth, GenerateRequest, GenerateResult,
                                              SamplingSettings, ScoreRequest, ScoreResult, check_version,
                                              untruncated_t1)
from megatron_specrl.rollout.coupled import coupled_tokens

EOS = 0


def process(logits: np.ndarray, s: SamplingSettings) -> np.ndarray:
    """Probabilities after temperature, top-k and top-p, as vLLM's apply_top_k_top_p_pytorch
    (ascending sort; drop the prefix whose cumulative mass is <= 1 - p, keep at least one)."""
    x = np.asarray(logits, dtype=np.float64) / s.temperature
    keep = np.ones(len(x), dtype=bool)
    order = np.argsort(x, kind="stable")
    if 0 < s.top_k < len(x):
        keep[order[: len(x) - s.top_k]] = False
    if s.top_p < 1.0:
        e = np.where(keep, np.exp(x - x.max()), 0.0)
        cum = np.cumsum(e[order] / e.sum())
        drop = cum <= 1 - s.top_p
        drop[-1] = False
        keep[order[drop]] = False
    e = np.where(keep, np.exp(x - x.max()), 0.0)
    return e / e.sum()


class TabularPolicy:
    """logits(context) = scale * base logits + drift * update logits; vocab 0..V-1, EOS = 0.

    Base logits are shared by every policy; `update_seed` and `drift` model a train step."""

    def __init__(self, vocab: int, update_seed: int = 0, drift: float = 0.0, scale: float = 2.5):
        self.vocab, self.update_seed, self.drift, self.scale = vocab, update_seed, drift, scale
        self._cache: dict = {}

    @staticmethod
    def _noise(key, size: int) -> np.ndarray:
        h = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
        return np.random.default_rng(int.from_bytes(h, "little")).normal(size=size)

    def logits(self, context: tuple[int, ...]) -> np.ndarray:
        return self.scale * self._noise(("base", context), self.vocab) \
            + self.drift * self._noise(("update", self.update_seed, context), self.vocab)

    def probs(self, context: tuple[int, ...], sampling: SamplingSettings | None = None) -> np.ndarray:
        s = sampling or SamplingSettings()
        key = (context, s.temperature, s.top_k, s.top_p)
        if key not in self._cache:
            self._cache[key] = process(self.logits(context), s)
            self._cache[key].setflags(write=False)
        return self._cache[key]

    def sequence_distribution(self, prompt: tuple[int, ...], max_len: int,
                              sampling: SamplingSettings | None = None) -> dict[tuple[int, ...], float]:
        """Exact probability of every response (ends at EOS or at max_len) with nonzero probability."""
        out: dict[tuple[int, ...], float] = {}

        def walk(resp: tuple[int, ...], prob: float):
            if (resp and resp[-1] == EOS) or len(resp) == max_len:
                out[resp] = prob
                return
            ps = self.probs(prompt + resp, sampling)
            for tok in np.nonzero(ps)[0]:
                walk(resp + (int(tok),), prob * ps[tok])

        walk((), 1.0)
        return out


def coupled_draw(probs: np.ndarray, seed: int, position: int) -> int:
    """The token coupled sampling draws from `probs` at response position `position`."""
    with np.errstate(divide="ignore"):
        lp = torch.from_numpy(np.log(probs)).unsqueeze(0)
    return int(coupled_tokens(lp, torch.tensor([seed]), torch.tensor([position]))[0])


class TabularEngine(EngineCapabilities):   # both flags are the instance's `replacements`
    name = "tabular"

    def __init__(self, policy: TabularPolicy, version: int = 0, replacements: bool = True):
        self.policy, self._version = policy, version
        self.verifies_processed_distribution = replacements
        self.samples_coupled = replacements
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
                p = self.policy.probs(ctx, sampling)
                draw = p.copy()
                if i == 0 and r.ban_first_token is not None:
                    draw[r.ban_first_token] = 0.0
                draw /= draw.sum()
                if r.coupled_seed is not None:
                    tok = coupled_draw(p, r.coupled_seed, len(ctx) - r.response_start)
                else:
                    tok = int(rng.choice(len(draw), p=draw))
                toks.append(tok)
                lps.append(math.log(p[tok]))     # processed log-prob, without the ban
                ctx = ctx + (tok,)
                if tok == EOS:
                    finish = "stop"
                    break
            results.append(GenerateResult(toks, lps, finish, 0, self._version))
        return results

    def score(self, requests: list[ScoreRequest], sampling: SamplingSettings, weight_version: int):
        check_version(self.name, self._version, weight_version)
        if not self.verifies_processed_distribution and not untruncated_t1(sampling):
            raise NotImplementedError("this tabular engine scores at temperature 1 without top-k / top-p only")
        self.calls.append("score")
        tempered = SamplingSettings(sampling.temperature)
        out = []
        for r in requests:
            ctx = tuple(r.prompt_ids)
            res = ScoreResult([], self._version, [], [], [], [], [])
            for pos, tok in enumerate(r.continuation_ids):
                full, proc = self.policy.probs(ctx, tempered), self.policy.probs(ctx, sampling)
                with np.errstate(divide="ignore"):
                    res.logprobs.append(math.log(full[tok]))
                    res.sample_logprobs.append(float(np.log(proc[tok])))
                    excl = proc.copy()
                    excl[tok] = 0.0
                    rep = -1
                    if r.coupled_seed is not None:   # the coupled draw at response position pos
                        rep = coupled_draw(proc, r.coupled_seed, pos)
                    elif excl.sum() > 0:
                        rng = np.random.default_rng([r.seed if r.seed is not None else 0, pos])
                        rep = int(rng.choice(len(excl), p=excl / excl.sum()))
                    res.replacements.append(rep)
                    res.replacement_logprobs.append(float(np.log(full[rep])) if rep >= 0 else -math.inf)
                    res.replacement_sample_logprobs.append(float(np.log(proc[rep])) if rep >= 0 else -math.inf)
                    res.replacement_stops.append(rep == EOS)
                ctx = ctx + (tok,)
            if not self.verifies_processed_distribution:
                res = ScoreResult(res.logprobs, self._version)
            out.append(res)
        return out

    def set_policy(self, policy: TabularPolicy, version: int) -> None:
        self.policy, self._version = policy, version

    def health(self):
        return EngineHealth(True, self._version)
