"""The tiny checkpoints are real HF checkpoints: transformers loads them, the tokenizer round-trips."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from megatron_specrl.data.synthetic import make_problems
from megatron_specrl.models.tiny import build_tiny_model


@pytest.mark.parametrize("fixture, arch, tied", [("tiny_llama", "llama", False), ("tiny_qwen2", "qwen2", True)])
def test_builds_and_loads_with_transformers(request, fixture, arch, tied):
    path = request.getfixturevalue(fixture)
    cfg = AutoConfig.from_pretrained(path)
    assert cfg.model_type == arch and cfg.tie_word_embeddings == tied
    assert cfg.hidden_size // cfg.num_attention_heads >= 32          # vLLM CPU attention needs head_dim >= 32
    assert cfg.num_key_value_heads < cfg.num_attention_heads         # GQA, so conversion bugs show
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    ids = torch.tensor([tok("Q:1+2+3=")["input_ids"]])
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], cfg.vocab_size) and torch.isfinite(logits).all()
    if arch == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0


def test_same_seed_same_weights(tmp_path):
    a = build_tiny_model(tmp_path / "a", seed=3)
    b = build_tiny_model(tmp_path / "b", seed=3)
    c = build_tiny_model(tmp_path / "c", seed=4)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert json.loads((a / "specrl_tiny.json").read_text())["seed"] == 3


def test_tokenizer_round_trip_and_special_tokens(tiny_llama):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    assert tok.pad_token_id != tok.eos_token_id
    for p in make_problems(50, seed=9):
        text = p.prompt + p.trace
        assert tok.decode(tok(text)["input_ids"]) == text
    ids = tok("3+4=7;A:7")["input_ids"] + [tok.eos_token_id]
    assert tok.decode(ids, skip_special_tokens=True) == "3+4=7;A:7"


def test_unknown_arch_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny architecture 'gpt2'"):
        build_tiny_model(tmp_path, arch="gpt2")
