"""Review of the vLLM engine's sampling edges (session 20). No vLLM engine is started: the two bugs
sit in code that runs before the engine (the temperature vLLM would change) or after it (reading the
verification columns), and are driven here through the patch's own math (`verify_rows`).

1. A verification row the model did not compute finitely (NaN / +inf logits) came back with a
   "replacement" drawn from NaN probabilities: the vocabulary's last token (coupled: token 0) with
   NaN log-probs. Acceptance rejects at the NaN, so the exact and coupled rollouts took that token as
   the first new one and stored / handed the learner a NaN log-prob. Such rows now have none (-1):
   the extension samples the position, and generate() refuses non-finite log-probs.
2. vLLM raises a temperature in (0, 0.01) to 0.01 with only a warning: rollouts were sampled and
   verified at 0.01 while the learner tempered with the configured temperature. The engine refuses
   it where log-probs matter (training generate, score); eval (need_logprobs=False) is unchanged.
"""

import os

import numpy as np
import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from megatron_specrl.engines.protocol import GenerateRequest, GenerateResult, SamplingSettings  # noqa: E402
from megatron_specrl.engines.vllm_engine import verify_columns  # noqa: E402
from megatron_specrl.rollout.speculative import SpeculativeRollout  # noqa: E402
from megatron_specrl.rollout.store import Trajectory, TrajectoryStore  # noqa: E402
from patches.vllm_0_32_0_batched_prompt_logprobs import (  # noqa: E402
    UNCOMPUTED, VerifyColumns, replacement_uniforms, verify_rows,
)

VOCAB = 40
EOS = frozenset({1})
S = SamplingSettings(temperature=0.7, top_p=0.9)


def _logits(n: int, broken: dict[int, float], seed: int = 0) -> torch.Tensor:
    """[n, VOCAB] logits; row j of `broken` gets the value there (NaN, or +inf in one entry)."""
    x = torch.from_numpy(np.random.default_rng(seed).normal(0, 2, (n, VOCAB)).astype(np.float32))
    for j, v in broken.items():
        if np.isnan(v):
            x[j] = v
        else:
            x[j, 3] = v
    return x


def _columns(prompt_len: int, draft: list[int], logits: torch.Tensor, seed: int, coupled_seed: int | None):
    """The container a verification request hands `verify_columns`, built by the patch's own math."""
    n = len(draft)
    coupled = None
    if coupled_seed is not None:
        coupled = (torch.ones(n, dtype=torch.bool), torch.full((n,), coupled_seed, dtype=torch.int64),
                   torch.arange(n, dtype=torch.int64))
    positions = np.arange(prompt_len, prompt_len + n)
    ids, lps, _ = verify_rows(logits, torch.tensor(draft, dtype=torch.int64), torch.full((n,), S.temperature),
                              torch.full((n,), VOCAB, dtype=torch.int32), torch.full((n,), S.top_p),
                              torch.from_numpy(replacement_uniforms(seed, positions)), coupled)
    out = VerifyColumns()
    prompt_rows = torch.tensor([[7, 7, UNCOMPUTED, UNCOMPUTED]] * (prompt_len - 1), dtype=torch.int64)
    out.add(prompt_rows, torch.full((prompt_len - 1, 4), float("nan")))   # rows before the draft: not read
    out.add(ids, lps)
    return out


@pytest.mark.parametrize("coupled_seed", [None, 5], ids=["exact", "coupled"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_rows_with_nonfinite_logits_have_no_replacement(coupled_seed, bad):
    draft = [4, 9, 11, 13]
    cols = _columns(3, draft, _logits(4, {1: bad, 3: bad}), seed=2, coupled_seed=coupled_seed)
    res = verify_columns(cols, 3, draft, EOS, 0, coupled=coupled_seed is not None)
    assert np.isnan(res.sample_logprobs[1]) and np.isnan(res.sample_logprobs[3])   # passed on: acceptance counts it
    assert res.replacements[1] == res.replacements[3] == -1, res.replacements
    assert not res.replacement_stops[1] and not res.replacement_stops[3]
    assert res.replacements[0] >= 0 and np.isfinite(res.replacement_sample_logprobs[0])   # finite rows keep theirs


class _Engine:
    """score() through the patch's math and verify_columns: row 0 keeps the draft token, row 1 is
    non-finite; generate() a fixed finite continuation."""

    verifies_processed_distribution = True
    samples_coupled = True
    name = "fake-vllm"

    def __init__(self, bad: float):
        self.bad, self.generated = bad, []

    def score(self, requests, sampling, version):
        out = []
        for i, r in enumerate(requests):
            logits = _logits(len(r.continuation_ids), {1: self.bad}, i)
            logits[0, r.continuation_ids[0]] = 50.0   # the draft's first token has all the mass: kept
            cols = _columns(len(r.prompt_ids), r.continuation_ids, logits, r.seed, r.coupled_seed)
            out.append(verify_columns(cols, len(r.prompt_ids), r.continuation_ids, EOS, version,
                                      coupled=r.coupled_seed is not None))
        return out

    def generate(self, requests, sampling, version):
        self.generated += requests
        return [GenerateResult([5] * r.max_new_tokens, [-0.5] * r.max_new_tokens, "length", 0, version)
                for r in requests]


@pytest.mark.parametrize("mode", ["exact", "coupled"])
def test_rollouts_never_take_a_token_drawn_from_nan_probabilities(mode):
    """Drafts whose verification row 1 is NaN: every sample rejects there (u < NaN is False) and must
    sample position 1 in the extension, never keep the NaN row's draw and its NaN log-prob."""
    L = 4
    store = TrajectoryStore()
    drafts = [[4 + k, 20 + k, 30, 31] for k in range(6)]
    for k, d in enumerate(drafts):
        store.put("p", k, Trajectory(d, [-1.0] * L, "length", 0, noise_seed=100 + k if mode == "coupled" else None))
    engine = _Engine(float("nan"))
    roll = SpeculativeRollout(engine, store, mode=mode, lenience=1.0, sampling=S, max_new_tokens=L, seed=3)
    samples, metrics = roll.run([("p", [2, 3, 6])], len(drafts), 1, step=1)
    for s, d in zip(samples, drafts):
        assert all(np.isfinite(s.logprobs)), (s.response_ids, s.logprobs)
        # d[0] kept, the NaN row rejected: position 1 on are the extension's tokens
        assert s.response_ids == [d[0]] + [5] * (L - 1), (d, s.response_ids)
    assert metrics["spec/nonfinite_logprobs"] >= len(drafts)
    assert all(np.isfinite(store.get("p", k).logprobs).all() for k in range(len(drafts)))


def _bare_engine():
    from megatron_specrl.engines.vllm_engine import VLLMEngine
    eng = VLLMEngine.__new__(VLLMEngine)   # no vLLM: the checks run before any engine call
    eng.logprobs_mode, eng.draft = "processed_logprobs", "none"
    return eng


def test_vllm_raises_small_temperatures_to_its_minimum():
    """What the refusal guards against, pinned to the installed vLLM (its constant is private)."""
    from vllm import SamplingParams
    from vllm.sampling_params import _MAX_TEMP

    from megatron_specrl.engines.vllm_engine import VLLM_MIN_TEMPERATURE
    assert _MAX_TEMP == VLLM_MIN_TEMPERATURE
    assert SamplingParams(temperature=0.005).temperature == VLLM_MIN_TEMPERATURE


@pytest.mark.parametrize("t", [0.005, 1e-4])
def test_temperatures_vllm_would_change_are_refused_where_log_probs_matter(t):
    from megatron_specrl.engines.protocol import ScoreRequest
    eng = _bare_engine()
    req = GenerateRequest([3, 4, 5], 4, seed=1)
    with pytest.raises(ValueError, match=r"below vLLM's smallest, 0.01"):
        eng._sampling_params(req, SamplingSettings(temperature=t))
    with pytest.raises(ValueError, match=r"below vLLM's smallest, 0.01"):
        eng.score([ScoreRequest([3, 4, 5], [6])], SamplingSettings(temperature=t), 0)
    # eval (no log-probs) keeps vLLM's behaviour; 0.01 itself and greedy are untouched
    assert eng._sampling_params(req, SamplingSettings(temperature=t, need_logprobs=False)).temperature == 0.01
    assert eng._sampling_params(req, SamplingSettings(temperature=0.01)).temperature == 0.01
    assert eng._sampling_params(req, SamplingSettings(temperature=0.0)).temperature == 0.0
