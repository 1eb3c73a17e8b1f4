"""The model families (models/families/): each family's table names exactly the tensors transformers builds
for it, with their shapes; the learner's TransformerConfig takes the family's settings; the tiny models'
names and the supported model types come from the one registry.
"""

from __future__ import annotations

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from megatron_specrl.learner import hf_mapping as hm
from megatron_specrl.models.families import FAMILIES, SUPPORTED_MODEL_TYPES, family_of
from megatron_specrl.models.families.shape import ModelShape


def _tiny_config(model_type: str):
    return AutoConfig.for_model(model_type, vocab_size=264, num_hidden_layers=2, max_position_embeddings=512,
                                **FAMILIES[model_type].tiny_config)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_familys_table_names_every_tensor_a_checkpoint_holds_with_its_shape(model_type, tmp_path):
    """expected_hf_shapes follows the family's rules (their hf_shapes); the checkpoint transformers saves is
    the truth (one tensor per expert, however transformers holds them in memory; a tied head saved once)."""
    from safetensors import safe_open
    cfg = _tiny_config(model_type)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(tmp_path), safe_serialization=True)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        saved = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert hm.expected_hf_shapes(cfg) == saved


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_learners_config_takes_the_familys_settings(model_type):
    from megatron_specrl.learner.model_provider import transformer_config_from_hf
    cfg = _tiny_config(model_type)
    s = ModelShape.from_hf(cfg)
    tc = transformer_config_from_hf(cfg, use_cpu=True)
    assert (tc.qk_layernorm, tc.add_qkv_bias, tc.kv_channels) == (s.qk_norm, s.qkv_bias, s.head_dim)
    assert (tc.num_moe_experts or 0, tc.moe_ffn_hidden_size if s.moe else 0) == (s.experts, s.expert_ffn)
    assert family_of(cfg).model_type == model_type


def test_the_tiny_models_and_the_supported_types_come_from_the_registry():
    from megatron_specrl.learner.model_provider import check_hf_config
    from megatron_specrl.models.resolve import TINY
    assert TINY == {"tiny-llama": "llama", "tiny-qwen2": "qwen2", "tiny-qwen3": "qwen3", "tiny-qwen3-moe": "qwen3_moe"}
    assert SUPPORTED_MODEL_TYPES == tuple(FAMILIES) == tuple(TINY.values())
    with pytest.raises(ValueError, match="unsupported model_type 'mistral'"):
        check_hf_config(AutoConfig.for_model("mistral"))


def test_a_model_type_no_family_covers_is_still_sized_as_a_dense_decoder():
    """The plan sizes it (and reports the unsupported type in its own line) rather than stopping at it."""
    s = ModelShape.from_hf(AutoConfig.for_model("mistral", hidden_size=128, num_attention_heads=4,
                                                num_key_value_heads=2, intermediate_size=256))
    assert (s.model_type, s.heads, s.kv_heads, s.head_dim, s.ffn, s.moe, s.qk_norm) == \
        ("mistral", 4, 2, 32, 256, False, False)
