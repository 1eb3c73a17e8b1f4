"""Tiny Llama / Qwen2 / Qwen3 / Qwen3-MoE checkpoints built locally from a seed (no hub downloads).

They are real HF checkpoints (config.json + safetensors + tokenizer files) so
every loader in the project, vLLM's included, reads them like a 7B model.
vLLM's CPU attention needs head_dim >= 32; its Qwen2 derives head_dim from
hidden/heads, so both families use hidden 128 with 4 heads.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

PAD, EOS, BOS = "<|pad|>", "<|endoftext|>", "<|bos|>"

DEFAULT_NUM_LAYERS = 2

ARCHS = {
    # GQA, untied embeddings, no QKV bias.
    "llama": dict(model_type="llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=256, tie_word_embeddings=False),
    # GQA, QKV bias, tied embeddings.
    "qwen2": dict(model_type="qwen2", hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=256, tie_word_embeddings=True),
    # GQA, q/k RMS norms, head_dim set in the config, untied embeddings (as Qwen3-8B and larger; tiny-qwen2
    # covers a tied head).
    "qwen3": dict(model_type="qwen3", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  intermediate_size=256, tie_word_embeddings=False),
    # Qwen3-30B-A3B's layout in small: every layer MoE, 8 experts, top-2 renormalised, untied.
    "qwen3_moe": dict(model_type="qwen3_moe", hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, intermediate_size=256, moe_intermediate_size=64, num_experts=8,
                      num_experts_per_tok=2, norm_topk_prob=True, router_aux_loss_coef=0.001, decoder_sparse_step=1,
                      mlp_only_layers=[], tie_word_embeddings=False),
}


def build_tokenizer(out_dir: Path, vocab_size: int = 264):
    """Byte-level BPE trained on the synthetic task's text; pad != eos on purpose."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from megatron_specrl.data.synthetic import corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[PAD, EOS, BOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, bos_token=BOS)
    fast.model_max_length = 1024
    fast.save_pretrained(str(out_dir))
    return fast


def build_tiny_model(out_dir: str | Path, arch: str = "llama", seed: int = 0, num_layers: int = DEFAULT_NUM_LAYERS,
                     max_position_embeddings: int = 512) -> Path:
    """Write a randomly initialised tiny checkpoint + tokenizer to out_dir and return it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch not in ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {sorted(ARCHS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out)
    spec = dict(ARCHS[arch])
    model_type = spec.pop("model_type")
    cfg = AutoConfig.for_model(
        model_type, vocab_size=len(tok), num_hidden_layers=num_layers,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6, rope_theta=10000.0,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
        dtype="float32", **spec,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if arch == "qwen2":  # make the QKV bias non-trivial so conversion bugs show
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.02)
    if arch in ("qwen3", "qwen3_moe"):  # q/k norms away from 1, so a swapped or dropped norm shows
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.normal_(1.0, 0.1)
                layer.self_attn.k_norm.weight.normal_(1.0, 0.1)
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "specrl_tiny.json").write_text(json.dumps({"arch": arch, "seed": seed, "num_layers": num_layers}))
    return out
