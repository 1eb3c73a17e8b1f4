"""Published HF configs, and a tiny model reshaped to one of them."""

from __future__ import annotations

import json
from pathlib import Path
import torch
import shutil


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


def _tiny_llama31(out: Path, tok_src: Path, head_dim: int) -> Path:
    """A 2-layer Llama with the 3.1 config fields, an explicit head_dim != hidden/heads, saved in bf16
    as several safetensors shards + index.json (like the published checkpoints)."""

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


