"""Review of tree drafting inside vLLM 0.32, through the real engine: what vLLM's runner hands the
proposer past a request's end, and the run-ahead loop's cleanup (the proposer-level tests of the same
are in tests/test_tree_proposer.py).

vLLM's runner appends every sampled token of a step to its input batch (`_bookkeeping_sync`), also
those past a stop token or past max_tokens: only the scheduler trims them (`_update_request_with_output`,
`check_stop`), and it never trims a draft to the tokens the request may still generate. So the
proposer must (a) not draft past max_tokens (wasted verification; with prompt + max_tokens at
rollout.max_model_len such a draft also uses the engine's draft headroom, and vLLM turns drafting off
for the whole batch), and (b) not enter into the trees, nor count, tokens the request never produced.
"""

import os
import random

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from megatron_specrl.engines.protocol import GenerateRequest, SamplingSettings  # noqa: E402


# -- through the real engine (one engine for this module: a second in-process engine breaks the first) --

@pytest.fixture(scope="module")
def engine(tiny_llama, tmp_path_factory):
    from megatron_specrl.engines.vllm_engine import VLLMEngine
    eng = VLLMEngine(str(tiny_llama), name="vllm-review-tree", seed=0, max_model_len=256, kv_cache_gb=0.25,
                     log_dir=tmp_path_factory.mktemp("engine-logs"), draft="tree", draft_tokens=8,
                     draft_settings={"min_prob": 0.0}, draft_fresh_prompts=True)   # drafting in flight from the start
    yield eng
    eng.shutdown()


GREEDY = SamplingSettings(temperature=0.0, need_logprobs=False)


@pytest.mark.slow
def test_engine_counts_only_the_tokens_a_request_returns(engine):
    """A request of 5 tokens whose tree holds 30 more: the prefill samples one, then one step of 3
    drafts + a bonus token ends it. Before, it drafted 8 (vLLM verified all 8 and dropped 5 of the 9
    tokens) and the counters took 10 generated tokens and 8 accepted ones for a 5-token response."""
    prompt = [9, 8, 7, 6, 5, 4]
    full = engine.generate([GenerateRequest(prompt, 30, draft_key="mt", response_start=len(prompt))], GREEDY, 0)
    assert len(full[0].token_ids) == 30, "greedy stopped early: nothing to check"
    engine.draft_stats()
    out = engine.generate([GenerateRequest(prompt, 5, draft_key="mt", response_start=len(prompt))], GREEDY, 0)
    stats = engine.draft_stats()
    assert out[0].token_ids == full[0].token_ids[:5]
    assert stats["generated_tokens"] == 5 and stats["request_steps"] == 2, stats
    assert stats["draft_tokens"] == 3 and stats["accepted_tokens"] == 3, stats


@pytest.mark.slow
def test_runahead_failure_leaves_no_request_in_the_engine(engine):
    """A request the engine refuses in the middle of the run-ahead loop (here a run-ahead prompt longer
    than max_model_len, added at the batch's tail) fails the call; the requests already added must not
    stay in vLLM, where the next `LLM.generate` would run them and sort its outputs by int(request id)."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 263) for _ in range(8)] for _ in range(4)]
    real = [GenerateRequest(p, 12, draft_key=f"fail-{i}", response_start=len(p)) for i, p in enumerate(prompts)]
    bad = GenerateRequest([5] * 400, 8, draft_key="fail-long", response_start=400, runahead=True)
    with pytest.raises(Exception, match="maximum context length"):
        engine.generate(real + [bad], GREEDY, 0)
    assert not engine.llm.llm_engine.has_unfinished_requests()
    plain = [GenerateRequest(p, 6) for p in prompts[:2]]
    out = engine.generate(plain, GREEDY, 0)
    assert len(out) == 2 and all(len(r.token_ids) == 6 for r in out)
