"""Real HF configs (Llama 3.1, Qwen2.5) through the converter: fields that change the math are either
honoured or refused with a one-line error naming the field; sharded bf16 checkpoints with an explicit
head_dim load and match HF transformers.

`megatron-specrl convert` on a bad HF directory: one line on stderr naming the problem.
"""

from __future__ import annotations
import json
import pytest
import torch
import shutil
from megatron_specrl.learner.convert import convert_main
from tests.helpers.hf_configs import LLAMA31_8B, _tiny_llama31  # noqa: F401



# ---- Real HF configs (Llama 3.1, Qwen2.5) through the converter: fields that change the math are either

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
        rope_theta,
        transformer_config_from_hf,
    )
    from megatron_specrl.models.families.shape import ModelShape
    cfg = _cfg(tmp_path, raw)
    check_hf_config(cfg)
    tc = transformer_config_from_hf(cfg, use_cpu=True)
    assert tc.layernorm_epsilon == raw["rms_norm_eps"]
    assert tc.kv_channels == raw["hidden_size"] // raw["num_attention_heads"]
    assert tc.num_query_groups == raw["num_key_value_heads"]
    assert tc.add_qkv_bias == (raw["model_type"] == "qwen2") == ModelShape.from_hf(cfg).qkv_bias
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




# ---- `megatron-specrl convert` on a bad HF directory: one line on stderr naming the problem.

@pytest.mark.parametrize("case,want", [("no-weights", "safetensors"), ("yarn", "yarn"), ("arch", "mistral")])
def test_bad_hf_dir_is_one_line(tiny_llama, tmp_path, capsys, case, want):
    d = tmp_path / "hf"
    shutil.copytree(tiny_llama, d)
    cfg = json.loads((d / "config.json").read_text())
    if case == "no-weights":
        (d / "model.safetensors").unlink()
    elif case == "yarn":
        cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
    else:
        cfg["model_type"] = "mistral"
    (d / "config.json").write_text(json.dumps(cfg))
    assert convert_main(["hf-to-mcore", "--hf", str(d), "--out", str(tmp_path / "out")]) == 1
    stderr = capsys.readouterr().err
    err = [line for line in stderr.splitlines() if line.startswith("convert failed")]
    assert len(err) == 1 and want in err[0], err
    assert "Traceback" not in stderr
