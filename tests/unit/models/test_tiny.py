"""The tiny checkpoints are real HF checkpoints: transformers loads them, the tokenizer round-trips.

models/resolve.py: an interrupted tiny-model build is not trusted later; bad model dirs give one line.
"""

import json
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from megatron_specrl.data.synthetic import make_problems
from megatron_specrl.models.tiny import build_tiny_model
from megatron_specrl.config import ConfigError, ModelConfig
from megatron_specrl.models.resolve import resolve_model



# ---- The tiny checkpoints are real HF checkpoints: transformers loads them, the tokenizer round-trips.

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


# ---- models/resolve.py: an interrupted tiny-model build is not trusted later; bad model dirs give one line.

def test_half_built_tiny_model_is_rebuilt(tmp_path, monkeypatch):
    """A first run killed while build_tiny_model was saving (config.json already written, weights not)
    must not leave a cache entry that every later run trusts."""
    monkeypatch.setenv("MEGATRON_SPECRL_CACHE", str(tmp_path))
    base = tmp_path / "tiny-llama-seed0"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"model_type": "llama"}))   # what save_pretrained writes first
    out = resolve_model(ModelConfig(path="tiny-llama", warmup_steps=0), seed=0)
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 128
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]   # no temp dir left behind
    again = resolve_model(ModelConfig(path="tiny-llama", warmup_steps=0), seed=0)
    assert again == out


def test_dir_without_config_json_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="no config.json") as e:
        resolve_model(ModelConfig(path=str(tmp_path), warmup_steps=0))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("files", [[], ["pytorch_model.bin"]], ids=["none", "bin-only"])
def test_dir_without_safetensors_is_one_line(tmp_path, files):
    """The learner reads *.safetensors only: say so before Ray and the ranks start, not from inside a rank."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    for f in files:
        (tmp_path / f).write_bytes(b"")
    with pytest.raises(ConfigError, match="safetensors") as e:
        resolve_model(ModelConfig(path=str(tmp_path), warmup_steps=0))
    assert "\n" not in str(e.value) and str(tmp_path) in str(e.value)
