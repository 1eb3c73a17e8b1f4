"""models/resolve.py: an interrupted tiny-model build is not trusted later; bad model dirs give one line."""

import json

import pytest

from megatron_specrl.config import ConfigError, ModelConfig
from megatron_specrl.models.resolve import resolve_model


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
