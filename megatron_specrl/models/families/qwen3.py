"""Qwen3 (`qwen3`): Llama's tensors plus an RMSNorm over each head's q and k (Megatron's QK layernorm),
no QKV bias, head_dim set in the config (Qwen3-4B: 128, although hidden 2560 / 32 heads is 80)."""

from __future__ import annotations

from megatron_specrl.models.families import llama
from megatron_specrl.models.families.base import HF_LAYER, LAYER, Family, Rule

QK_NORMS = (
    Rule(LAYER + "self_attention.q_layernorm.weight", (HF_LAYER + "self_attn.q_norm.weight",), "rep",
         hf_shapes=(("D",),)),
    Rule(LAYER + "self_attention.k_layernorm.weight", (HF_LAYER + "self_attn.k_norm.weight",), "rep",
         hf_shapes=(("D",),)),
)
ATTENTION = (*llama.ATTENTION, *QK_NORMS)
RULES = (llama.EMBEDDING, *ATTENTION, llama.MLP_NORM, *llama.MLP, llama.FINAL_NORM, llama.OUTPUT)


class Qwen3(Family):
    model_type = "qwen3"
    tiny_name = "tiny-qwen3"
    # GQA, q/k RMS norms, head_dim set in the config, untied embeddings (as Qwen3-8B and larger; tiny-qwen2
    # covers a tied head).
    tiny_config = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                       intermediate_size=256, tie_word_embeddings=False)
    rules = RULES
    qk_norm = True

    def init_tiny(self, model) -> None:
        """q / k norms drawn away from transformers' ones, so a swapped or dropped norm shows."""
        import torch
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.normal_(1.0, 0.1)
                layer.self_attn.k_norm.weight.normal_(1.0, 0.1)


FAMILY = Qwen3()
