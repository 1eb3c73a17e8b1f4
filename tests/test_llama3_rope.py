"""Llama 3.1's RoPE scaling (rope_type llama3, which the 70B recipe's config has) through Megatron's
rope_scaling: the learner's logits and gradients equal HF transformers', and the scaling matters."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_learner_layouts import B, _run, make_batch

LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192, "rope_type": "llama3"}


def _with_rope_scaling(src: Path, dst: Path, scaling: dict) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["rope_scaling"] = scaling
    cfg["max_position_embeddings"] = 16384
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.slow
def test_llama3_rope_scaling_matches_hf(tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM
    hf_dir = _with_rope_scaling(tiny_llama, tmp_path / "llama3", LLAMA3)
    plain = _with_rope_scaling(tiny_llama, tmp_path / "plain", {"rope_type": "default"})
    ids = make_batch(hf_dir)["input_ids"]
    scaled_logits = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)(ids).logits
    plain_logits = AutoModelForCausalLM.from_pretrained(str(plain), dtype=torch.float32)(ids).logits
    # On 12 positions only the slowest frequencies are scaled, so the logits move little (5e-5 measured),
    # still 5x the 1e-5 the learner is held to below; the frequencies themselves are compared exactly next.
    assert (scaled_logits - plain_logits).abs().max() > 3e-5
    out = tmp_path / "run"
    out.mkdir()
    _run(hf_dir, out, 1, [(1, 1, 1, None)])                         # logits, log-probs, grads vs HF at 1e-5
    assert B == ids.shape[0]


def test_megatron_rotary_frequencies_equal_hf_llama3():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import (
        RotaryEmbedding,
    )
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    cfg = AutoConfig.for_model("llama", hidden_size=128, num_attention_heads=4, max_position_embeddings=16384,
                               rope_theta=500000.0, rope_scaling=dict(LLAMA3, rope_theta=500000.0))
    hf_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    mc = RotaryEmbedding(kv_channels=32, rotary_percent=1.0, rotary_base=500000, rope_scaling=True,
                         rope_scaling_factor=8.0, use_cpu_initialization=True)
    plain = RotaryEmbedding(kv_channels=32, rotary_percent=1.0, rotary_base=500000, use_cpu_initialization=True)
    assert torch.allclose(mc.inv_freq.float(), hf_freq.float(), rtol=1e-6, atol=0)
    assert not torch.allclose(plain.inv_freq.float(), hf_freq.float(), rtol=1e-3)


def test_llama3_constants_megatron_does_not_take_are_refused():
    from transformers import AutoConfig

    from megatron_specrl.learner.model_provider import (
        check_hf_config,
        llama3_rope_factor,
    )
    cfg = AutoConfig.for_model("llama", rope_scaling=dict(LLAMA3))
    assert llama3_rope_factor(cfg) == 8.0
    check_hf_config(cfg)
    bad = AutoConfig.for_model("llama", rope_scaling=dict(LLAMA3, high_freq_factor=2.0))
    with pytest.raises(ValueError, match="high_freq_factor=2.0: Megatron fixes it at 4"):
        check_hf_config(bad)
