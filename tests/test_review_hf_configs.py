"""Review of HF config -> Megatron shape checks: `convert`'s pre-spawn layout check names every
config field a --tp must divide (intermediate_size included, as the run plan's _divisibility does)."""

from __future__ import annotations

import json

import pytest


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
