"""Review of tree drafting inside vLLM 0.32: what vLLM's runner hands the proposer past a request's
end, and the run-ahead loop's cleanup.

vLLM's runner appends every sampled token of a step to its input batch (`_bookkeeping_sync`), also
those past a stop token or past max_tokens: only the scheduler trims them (`_update_request_with_output`,
`check_stop`), and it never trims a draft to the tokens the request may still generate. So the
proposer must (a) not draft past max_tokens (wasted verification; with prompt + max_tokens at
rollout.max_model_len such a draft also uses the engine's draft headroom, and vLLM turns drafting off
for the whole batch), and (b) not enter into the trees, nor count, tokens the request never produced.
"""

import os
import random
from types import SimpleNamespace

import numpy as np
import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from megatron_specrl.engines import tree_proposer as tp  # noqa: E402
from megatron_specrl.engines.protocol import GenerateRequest, SamplingSettings  # noqa: E402
from megatron_specrl.engines.tree_drafter import SHARED_KEY  # noqa: E402

EOS = 2


def _proposer(monkeypatch, k=8, max_model_len=256, **settings):
    monkeypatch.setenv(tp.SETTINGS_ENV, tp.settings_env(**settings))
    cfg = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k),
                          model_config=SimpleNamespace(max_model_len=max_model_len))
    return tp.TreeProposer(cfg)


class Batch:
    """The runner's input batch as the patch hands it over; requests carry vLLM's SamplingParams."""

    def __init__(self):
        self.token_ids_cpu = np.zeros((4, 256), dtype=np.int64)
        self.num_tokens_no_spec = np.zeros(4, dtype=np.int64)
        self.req_ids, self.requests = [], {}

    def add(self, req_id, prompt, key, max_tokens, stop_token_ids=None):
        from vllm import SamplingParams
        i = len(self.req_ids)
        self.req_ids.append(req_id)
        self.token_ids_cpu[i, :len(prompt)] = prompt
        self.num_tokens_no_spec[i] = len(prompt)
        params = SamplingParams(max_tokens=max_tokens, stop_token_ids=stop_token_ids,
                                extra_args={tp.DRAFT_KEY: key, tp.RESPONSE_START: len(prompt)})
        params.update_from_generation_config({}, EOS)      # as vLLM's input processor does
        self.requests[req_id] = SimpleNamespace(prompt_token_ids=list(prompt), sampling_params=params)

    def sample(self, i, tokens):
        n = self.num_tokens_no_spec[i]
        self.token_ids_cpu[i, n:n + len(tokens)] = tokens
        self.num_tokens_no_spec[i] = n + len(tokens)
        return list(tokens)


def test_drafts_stop_at_the_requests_remaining_max_tokens(monkeypatch):
    """A request that may generate r more tokens gains at most r from a step: the step's bonus token
    plus r - 1 draft tokens. vLLM's scheduler verifies whatever it is given."""
    p = _proposer(monkeypatch, k=8, min_prob=0.0)
    p.trees.insert("q", list(range(10, 40)))
    b = Batch()
    b.add("a", [50, 51], "q", max_tokens=5)
    assert p.propose_batch(b, b.requests, [b.sample(0, [10])]) == [[11, 12, 13]]   # 4 more tokens: 3 + bonus
    assert p.propose_batch(b, b.requests, [b.sample(0, [11, 12])]) == [[13]]        # 2 more: 1 + bonus


def test_tokens_past_a_stop_or_max_tokens_enter_no_tree_and_no_counter(monkeypatch):
    """The runner hands over all of a step's sampled tokens; the scheduler keeps them up to the first
    stop token (EOS or stop_token_ids) or up to max_tokens, and the request ends there."""
    p = _proposer(monkeypatch, k=8, min_prob=0.0)
    b = Batch()
    b.add("eos", [50], "q", max_tokens=20)
    b.add("stop", [50], "q", max_tokens=20, stop_token_ids=[7])
    b.add("len", [50], "q", max_tokens=3)
    p.propose_batch(b, b.requests, [b.sample(0, [4]), b.sample(1, [4]), b.sample(2, [4])])
    # a step accepting drafts through the end: [5, EOS] and [5, 7] and [5, 6] are kept
    p.propose_batch(b, b.requests, [b.sample(0, [5, EOS, 8, 9]), b.sample(1, [5, 7, 8, 9]),
                                    b.sample(2, [5, 6, 8, 9])])
    for tree in ("q", SHARED_KEY):
        assert p.trees.count(tree, [4, 5]) == 3
        assert p.trees.count(tree, [8]) == 0 and p.trees.count(tree, [9]) == 0, tree
    stats = p.take_stats()
    assert stats["generated_tokens"] == 3 * 3, stats


def test_drafts_end_at_a_stop_token(monkeypatch):
    """Draft tokens after a stop token are verified for nothing: the request ends at the stop token."""
    p = _proposer(monkeypatch, k=8, min_prob=0.0)
    p.trees.insert("q", [10, 11, EOS])
    p.trees.insert(SHARED_KEY, [10, 11, EOS, 30, 31, 32])   # another prompt's tree went on past EOS
    b = Batch()
    b.add("a", [50], "q", max_tokens=20)
    assert p.propose_batch(b, b.requests, [b.sample(0, [10])]) == [[11, EOS]]


# -- through the real engine (one engine for this module: a second in-process engine breaks the first) --

@pytest.fixture(scope="module")
def engine(tiny_llama, tmp_path_factory):
    from megatron_specrl.engines.vllm_engine import VLLMEngine
    eng = VLLMEngine(str(tiny_llama), name="vllm-review-tree", seed=0, max_model_len=256, kv_cache_gb=0.25,
                     log_dir=tmp_path_factory.mktemp("engine-logs"), draft="tree", draft_tokens=8,
                     draft_settings={"min_prob": 0.0})
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
