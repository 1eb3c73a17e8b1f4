"""Real HF configs (Llama 3.1, Qwen2.5) through the converter: fields that change the math are either
honoured or refused with a one-line error naming the field; sharded bf16 checkpoints with an explicit
head_dim load and match HF transformers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
    "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 152064,
}
QWEN25_05B = dict(QWEN25_7B, hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_hidden_layers=24,
                  num_key_value_heads=2, max_window_layers=21, tie_word_embeddings=True, vocab_size=151936)
QWEN25_MATH_7B = dict(QWEN25_7B, max_position_embeddings=4096, rope_theta=10000.0, sliding_window=4096)


def _cfg(tmp_path, d: dict, name: str = "m"):
    from transformers import AutoConfig
    out = tmp_path / name
    out.mkdir()
    (out / "config.json").write_text(json.dumps(d))
    return AutoConfig.from_pretrained(str(out))


@pytest.mark.parametrize("raw", [LLAMA31_8B, QWEN25_7B, QWEN25_05B, QWEN25_MATH_7B],
                         ids=["llama3.1-8b", "qwen2.5-7b", "qwen2.5-0.5b", "qwen2.5-math-7b"])
def test_published_configs_map_to_the_same_math(tmp_path, raw):
    from megatron_specrl.learner import hf_mapping as hm
    from megatron_specrl.learner.model_provider import (
        check_hf_config,
        llama3_rope_factor,
        qkv_bias,
        rope_theta,
        transformer_config_from_hf,
    )
    cfg = _cfg(tmp_path, raw)
    check_hf_config(cfg)
    tc = transformer_config_from_hf(cfg, use_cpu=True)
    assert tc.layernorm_epsilon == raw["rms_norm_eps"]
    assert tc.kv_channels == raw["hidden_size"] // raw["num_attention_heads"]
    assert tc.num_query_groups == raw["num_key_value_heads"]
    assert tc.add_qkv_bias == (raw["model_type"] == "qwen2") == qkv_bias(cfg)
    assert rope_theta(cfg) == raw["rope_theta"]
    assert llama3_rope_factor(cfg) == (8.0 if raw["model_type"] == "llama" else None)
    assert hm._tied(cfg) == raw["tie_word_embeddings"]


@pytest.mark.parametrize("extra,field", [
    ({"attention_bias": True}, "attention_bias"),          # HF Llama: bias on q, k, v AND o_proj
    ({"mlp_bias": True}, "mlp_bias"),                      # HF Llama: bias on gate/up/down
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}, "yarn"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_llama_fields_that_change_the_math_are_refused(tmp_path, extra, field):
    from megatron_specrl.learner.model_provider import check_hf_config
    cfg = _cfg(tmp_path, dict(LLAMA31_8B, **extra))
    with pytest.raises(ValueError, match=field) as e:
        check_hf_config(cfg)
    assert "\n" not in str(e.value)


def test_qwen2_sliding_window_is_refused(tmp_path):
    """use_sliding_window=true makes HF attend within sliding_window on layers >= max_window_layers."""
    from megatron_specrl.learner.model_provider import check_hf_config
    cfg = _cfg(tmp_path, dict(QWEN25_7B, use_sliding_window=True, sliding_window=4096, max_window_layers=20))
    with pytest.raises(ValueError, match="use_sliding_window"):
        check_hf_config(cfg)


def test_plan_reports_llama_attention_bias(tmp_path):
    """The refusal reaches the pre-flight plan (one line naming model.path and the field)."""
    from megatron_specrl.plan import _hf_support
    cfg = _cfg(tmp_path, dict(LLAMA31_8B, attention_bias=True))

    class _Run:
        class model:
            path = "/models/llama"
    errs = _hf_support(_Run, cfg)
    assert len(errs) == 1 and "attention_bias" in errs[0] and "\n" not in errs[0]


def _tiny_llama31(out: Path, tok_src: Path, head_dim: int) -> Path:
    """A 2-layer Llama with the 3.1 config fields, an explicit head_dim != hidden/heads, saved in bf16
    as several safetensors shards + index.json (like the published checkpoints)."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM
    src_cfg = json.loads((tok_src / "config.json").read_text())
    cfg = AutoConfig.for_model(
        "llama", vocab_size=src_cfg["vocab_size"], hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=16384,
        rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=dict(LLAMA31_8B["rope_scaling"]),
        pad_token_id=src_cfg["pad_token_id"], eos_token_id=src_cfg["eos_token_id"],
        bos_token_id=src_cfg["bos_token_id"], tie_word_embeddings=False)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))   # non-trivial RMSNorm weights
    model.to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True, max_shard_size="100KB")
    for f in tok_src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy2(f, out / f.name)
    return out


def test_sharded_bf16_checkpoint_with_explicit_head_dim_converts(tiny_llama, tmp_path):
    from transformers import AutoConfig

    from megatron_specrl.learner import hf_mapping as hm
    from megatron_specrl.learner.worker import load_hf_state
    d = _tiny_llama31(tmp_path / "l31", tiny_llama, head_dim=48)
    assert len(list(d.glob("*.safetensors"))) > 1 and (d / "model.safetensors.index.json").is_file()
    cfg = AutoConfig.from_pretrained(str(d))
    sd = load_hf_state(d)
    assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 48, 128)
    assert sd["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    for tp in (1, 2):
        shards = hm.hf_to_megatron_shards(sd, cfg, tp, 2)
        back = hm.megatron_shards_to_hf(shards, cfg, tp, 2)
        assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)


@pytest.mark.slow
def test_sharded_bf16_llama31_explicit_head_dim_matches_hf(tiny_llama, tmp_path):
    """Megatron learner (fp32, TP2) on a sharded bf16 Llama-3.1-style checkpoint with head_dim=48:
    logits, log-probs and gradients equal HF transformers' (loaded in fp32) at 1e-5."""
    from test_learner_layouts import _run
    d = _tiny_llama31(tmp_path / "l31", tiny_llama, head_dim=48)
    out = tmp_path / "run"
    out.mkdir()
    _run(d, out, 2, [(2, 1, 1, None)])
