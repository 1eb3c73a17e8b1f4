"""Tiny Llama / Qwen2 / Qwen3 / Qwen3-MoE checkpoints built locally from a seed (no hub downloads).

They are real HF checkpoints (config.json + safetensors + tokenizer files) so
every loader in the project, vLLM's included, reads them like a 7B model.
Each family's module (models/families/) gives its tiny config and the weights
it sets after the seeded initialisation; this module builds any of them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_specrl.models.families import FAMILIES

PAD, EOS, BOS = "<|pad|>", "<|endoftext|>", "<|bos|>"

DEFAULT_NUM_LAYERS = 2


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

    if arch not in FAMILIES:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {sorted(FAMILIES)}")
    family = FAMILIES[arch]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out)
    cfg = AutoConfig.for_model(
        family.model_type, vocab_size=len(tok), num_hidden_layers=num_layers,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6, rope_theta=10000.0,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
        dtype="float32", **family.tiny_config,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    family.init_tiny(model)
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "specrl_tiny.json").write_text(json.dumps({"arch": arch, "seed": seed, "num_layers": num_layers}))
    return out
