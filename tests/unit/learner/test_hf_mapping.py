"""HF <-> Megatron shard mapping: bit-exact round trips, layout details, clear errors.

Review of HF config -> Megatron shape checks: `convert`'s pre-spawn layout check names every
config field a --tp must divide (intermediate_size, or an MoE model's moe_intermediate_size, by the one layout rule).
"""

from __future__ import annotations
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig
from megatron_specrl.learner import hf_mapping as hm
from megatron_specrl.models.families import llama
from megatron_specrl.models.families.shape import ModelShape
import json



# ---- HF <-> Megatron shard mapping: bit-exact round trips, layout details, clear errors.

def _load(d):
    return AutoConfig.from_pretrained(str(d)), load_file(str(d / "model.safetensors"))


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_round_trip_bit_exact(fixture, tp, pp, request):
    cfg, sd = _load(request.getfixturevalue(fixture))
    shards = hm.hf_to_megatron_shards(sd, cfg, tp, pp)
    assert set(shards) == {(t, p) for t in range(tp) for p in range(pp)}
    back = hm.megatron_shards_to_hf(shards, cfg, tp, pp)
    assert set(back) == set(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


@pytest.mark.parametrize("fixture,tp,pp,ep", [("tiny_qwen3", 2, 2, 1), ("tiny_qwen3_moe", 2, 1, 2),
                                               ("tiny_qwen3_moe", 1, 2, 2), ("tiny_qwen3_moe", 2, 2, 2)])
def test_qwen3_families_round_trip_bit_exact_through_tp_pp_and_ep(fixture, tp, pp, ep, request):
    """Each EP rank's shards hold only its experts, numbered from 0; merged back over EP and TP / PP
    they give the HF tensors bit for bit (q/k norms, router and every expert included)."""
    cfg, sd = _load(request.getfixturevalue(fixture))
    per_rank = [hm.hf_to_megatron_shards(sd, cfg, tp, pp, ep=ep, ep_rank=r) for r in range(ep)]
    n_local = ModelShape.from_hf(cfg).experts // ep
    for shards in per_rank:
        experts = {hm.expert_index(k) for k in shards[(0, 0)]} - {None}
        assert experts == set(range(n_local))
    merged = {k: hm.merge_ep_shards([per_rank[r][k] for r in range(ep)], cfg) for k in per_rank[0]}
    back = hm.megatron_shards_to_hf(merged, cfg, tp, pp)
    assert set(back) == set(sd)
    assert all(torch.equal(back[k], sd[k]) for k in sd)


def test_ep_rank_1_holds_the_second_half_of_the_experts(tiny_qwen3_moe):
    cfg, sd = _load(tiny_qwen3_moe)
    shards = hm.hf_to_megatron_shards(sd, cfg, 1, 1, ep=2, ep_rank=1)[(0, 0)]
    local0 = shards["decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight"]
    assert torch.equal(local0, sd["model.layers.1.mlp.experts.4.down_proj.weight"])
    assert hm.ep_global_name("decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight", cfg, 2, 1) == \
        "decoder.layers.1.mlp.experts.local_experts.4.linear_fc2.weight"
    assert torch.equal(shards["decoder.layers.0.mlp.router.weight"], sd["model.layers.0.mlp.gate.weight"])


def test_a_swapped_expert_mapping_moves_exactly_experts_0_and_1(tiny_qwen3_moe):
    """The resync checker's injected expert bug: experts 0 and 1 of every layer trade places (their
    tensors differ, so a comparison against the source catches it); nothing else changes."""
    cfg, sd = _load(tiny_qwen3_moe)
    shards = hm.hf_to_megatron_shards(sd, cfg, 2, 1)
    bad = hm.megatron_shards_to_hf(shards, cfg, 2, 1,
                                   mapping=hm.miswired(hm.get_mapping(cfg), hm.MISWIRINGS["swap_experts"]))
    wrong = {k for k in sd if not torch.equal(bad[k], sd[k])}
    assert wrong == {f"model.layers.{i}.mlp.experts.{e}.{p}_proj.weight"
                     for i in range(2) for e in (0, 1) for p in ("gate", "up", "down")}
    assert torch.equal(bad["model.layers.0.mlp.experts.0.down_proj.weight"],
                       sd["model.layers.0.mlp.experts.1.down_proj.weight"])


def test_an_ep_that_does_not_divide_the_experts_is_refused(tiny_qwen3_moe):
    cfg, sd = _load(tiny_qwen3_moe)
    with pytest.raises(hm.CheckpointError, match="learner.ep=3 does not divide num_experts=8"):
        hm.hf_to_megatron_shards(sd, cfg, 1, 1, ep=3, ep_rank=0)


def test_layout_details(tiny_qwen2):
    """QKV per query group, fc1 = [gate_r; up_r] per TP rank, local layer numbering, tied head on last stage."""
    cfg, sd = _load(tiny_qwen2)
    shards = hm.hf_to_megatron_shards(sd, cfg, tp=2, pp=2)
    hd, qpg = 32, 2
    s = shards[(1, 1)]  # tp rank 1, last stage: global layer 1 is local layer 0
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in s and "decoder.layers.1.mlp.linear_fc1.weight" not in s
    qkv = s["decoder.layers.0.self_attention.linear_qkv.weight"]
    p = "model.layers.1.self_attn."
    # tp rank 1 holds query group 1: [q heads 2,3; k head 1; v head 1]
    assert torch.equal(qkv[: qpg * hd], sd[p + "q_proj.weight"][2 * hd: 4 * hd])
    assert torch.equal(qkv[qpg * hd: (qpg + 1) * hd], sd[p + "k_proj.weight"][hd: 2 * hd])
    assert torch.equal(qkv[(qpg + 1) * hd:], sd[p + "v_proj.weight"][hd: 2 * hd])
    bias = s["decoder.layers.0.self_attention.linear_qkv.bias"]
    assert torch.equal(bias[qpg * hd: (qpg + 1) * hd], sd[p + "k_proj.bias"][hd: 2 * hd])
    fc1 = s["decoder.layers.0.mlp.linear_fc1.weight"]
    F = cfg.intermediate_size
    assert torch.equal(fc1[: F // 2], sd["model.layers.1.mlp.gate_proj.weight"][F // 2:])
    assert torch.equal(fc1[F // 2:], sd["model.layers.1.mlp.up_proj.weight"][F // 2:])
    # tied: the last stage holds a copy of the (padded) embedding as output_layer
    V = hm.padded_vocab(cfg, 2)
    out = s["output_layer.weight"]
    assert out.shape == (V // 2, cfg.hidden_size)
    full = torch.cat([shards[(0, 1)]["output_layer.weight"], out])
    assert torch.equal(full[: cfg.vocab_size], sd["model.embed_tokens.weight"])
    assert full[cfg.vocab_size:].abs().sum() == 0
    assert "output_layer.weight" not in hm.hf_to_megatron_shards(sd, cfg, 1, 1)[(0, 0)]


def test_only_builds_one_rank(tiny_llama):
    cfg, sd = _load(tiny_llama)
    one = hm.hf_to_megatron_shards(sd, cfg, 2, 2, only=(1, 0))
    full = hm.hf_to_megatron_shards(sd, cfg, 2, 2)
    assert set(one) == {(1, 0)}
    assert all(torch.equal(one[(1, 0)][k], full[(1, 0)][k]) for k in full[(1, 0)])


@pytest.mark.parametrize("flag", ["swap_kv", "swap_gate_up"])
def test_swapped_mapping_is_detectable(tiny_llama, flag):
    """A wrong merge changes tensors, so a checker comparing against the source must fail."""
    cfg, sd = _load(tiny_llama)
    shards = hm.hf_to_megatron_shards(sd, cfg, 2, 1)
    bad = hm.megatron_shards_to_hf(shards, cfg, 2, 1, mapping=hm.miswired(hm.get_mapping(cfg), hm.MISWIRINGS[flag]))
    wrong = [k for k in sd if not torch.equal(bad[k], sd[k])]
    assert wrong and all(("k_proj" in k or "v_proj" in k) if flag == "swap_kv" else ("gate" in k or "up" in k)
                         for k in wrong)
    # merge_tp_shards_to_hf is what the resync code uses, one parameter at a time
    pairs = hm.merge_tp_shards_to_hf("decoder.layers.0.mlp.linear_fc1.weight",
                                     [shards[(t, 0)]["decoder.layers.0.mlp.linear_fc1.weight"] for t in range(2)],
                                     cfg, 0)
    assert [n for n, _ in pairs] == ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(pairs[0][1], sd["model.layers.0.mlp.gate_proj.weight"])


def test_custom_mapping_injection(tiny_llama):
    cfg, sd = _load(tiny_llama)
    wrong = tuple(hm.Rule(r.megatron, (r.hf[1], r.hf[0]), r.kind) if r.kind == "fc1" else r for r in llama.RULES)
    shards = hm.hf_to_megatron_shards(sd, cfg, 1, 1)
    bad = hm.megatron_shards_to_hf(shards, cfg, 1, 1, mapping=wrong)
    assert not torch.equal(bad["model.layers.0.mlp.up_proj.weight"], sd["model.layers.0.mlp.up_proj.weight"])


@pytest.mark.parametrize("corrupt,match", [
    (lambda sd: sd.pop("model.layers.1.self_attn.k_proj.weight"), "model.layers.1.self_attn.k_proj.weight"),
    (lambda sd: sd.__setitem__("model.layers.0.mlp.down_proj.weight", torch.zeros(128, 255)),
     r"model.layers.0.mlp.down_proj.weight.*\[128, 255\]"),
    (lambda sd: sd.__setitem__("model.embed_tokens.weight", torch.zeros(300, 128)), "vocab mismatch.*model.embed_tokens.weight.*300"),
    (lambda sd: sd.__setitem__("model.layers.7.mlp.up_proj.weight", torch.zeros(1)), "unexpected tensor 'model.layers.7"),
])
def test_bad_checkpoint_names_tensor(tiny_llama, corrupt, match):
    cfg, sd = _load(tiny_llama)
    corrupt(sd)
    with pytest.raises(hm.CheckpointError, match=match):
        hm.hf_to_megatron_shards(sd, cfg, 2, 2)


def test_missing_megatron_shard_names_tensor(tiny_llama):
    cfg, sd = _load(tiny_llama)
    shards = hm.hf_to_megatron_shards(sd, cfg, 2, 1)
    del shards[(1, 0)]["decoder.layers.1.self_attention.linear_proj.weight"]
    with pytest.raises(hm.CheckpointError, match="decoder.layers.1.self_attention.linear_proj.weight"):
        hm.megatron_shards_to_hf(shards, cfg, 2, 1)


def test_corrupt_safetensors_file(tmp_path):
    from megatron_specrl.learner.worker import load_hf_state
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00garbage")
    with pytest.raises(hm.CheckpointError, match="model.safetensors"):
        load_hf_state(tmp_path)


def test_local_param_name_follows_transformer_engine_renames():
    local = "decoder.layers.3.input_layernorm.weight"
    te = "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"
    assert hm.local_param_name(local, {local: 0}) == local
    assert hm.local_param_name(local, {te: 0}) == te
    assert hm.local_param_name("decoder.layers.0.pre_mlp_layernorm.weight",
                               {"decoder.layers.0.mlp.linear_fc1.layer_norm_weight": 0}).endswith("layer_norm_weight")
    with pytest.raises(KeyError, match="no parameter"):
        hm.local_param_name("decoder.final_layernorm.weight", {})


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1)])
def test_resync_order_keeps_each_layer_in_one_bucket(fixture, tp, pp, request):
    """The learner's resync order (LearnerWorker._param_order, merged the way iter_hf_state merges)
    must give each layer's tensors consecutively: plan_buckets only keeps consecutive tensors of a
    layer together, and vLLM's in-place reload fills a module loaded only in part (Qwen2's qkv_proj
    weight in one bucket, its bias in the next) with uninitialised memory."""
    from types import SimpleNamespace

    from megatron_specrl.learner.worker import LearnerWorker
    from megatron_specrl.resync.buckets import layer_group, plan_buckets

    cfg, sd = _load(request.getfixturevalue(fixture))
    shards = hm.hf_to_megatron_shards(sd, cfg, tp, pp)
    fake = SimpleNamespace(hf_config=cfg, settings=SimpleNamespace(pp=pp), role="policy")
    order = []
    for stage, name, g in LearnerWorker._param_order(fake):
        parts = [shards[(t, stage)][name] for t in range(tp)]
        order += hm.merge_tp_shards_to_hf(name, parts, cfg, g)
    assert sorted(n for n, _ in order) == sorted(sd)
    layer_bytes = max(sum(t.numel() * t.element_size() for n, t in order if layer_group(n) == key)
                      for key in {layer_group(n) for n, _ in order})
    for budget in (1, layer_bytes, 2 * layer_bytes + 1):
        seen = {}
        for k, bucket in enumerate(plan_buckets(iter(order), budget)):
            for n in bucket.names:
                assert seen.setdefault(layer_group(n), k) == k, f"{n} split from its layer (budget {budget})"


# ---- Review of HF config -> Megatron shape checks: `convert`'s pre-spawn layout check names every

def _config_dir(tmp_path, **overrides):
    raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
           "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 256, "num_hidden_layers": 2,
           "vocab_size": 264, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
           "hidden_act": "silu", "tie_word_embeddings": False}
    raw.update(overrides)
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(raw))
    return d


def test_convert_layout_refuses_tp_not_dividing_intermediate_size(tmp_path):
    """Heads (4) and KV heads (2) divide --tp=2 but intermediate_size=255 does not: before the fix the
    check passed and the spawned ranks died on Megatron's 'ColumnParallelLinear' assert (no field named)."""
    from megatron_specrl.plan import PlanError, check_convert_layout
    d = _config_dir(tmp_path, intermediate_size=255)
    with pytest.raises(PlanError) as e:
        check_convert_layout(d, tp=2, pp=1)
    msg = str(e.value)
    assert "intermediate_size=255" in msg and "--tp=2" in msg and "\n" not in msg.strip()


def test_convert_layout_accepts_a_dividing_layout(tmp_path):
    from megatron_specrl.plan import check_convert_layout
    check_convert_layout(_config_dir(tmp_path), tp=2, pp=2)
