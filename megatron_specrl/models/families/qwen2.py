"""Qwen2 / Qwen2.5 (`qwen2`): Llama's layout and tensor names with a bias on q, k and v, always.

HF Qwen2 has no attention_bias field: its q / k / v projections are biased and o_proj is not, which
Megatron's add_qkv_bias builds exactly.
"""

from __future__ import annotations

from megatron_specrl.models.families import llama
from megatron_specrl.models.families.base import Family


class Qwen2(Family):
    model_type = "qwen2"
    tiny_name = "tiny-qwen2"
    # GQA, QKV bias, tied embeddings. vLLM's Qwen2 derives head_dim from hidden / heads (>= 32 on CPU).
    tiny_config = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
                       tie_word_embeddings=True)
    rules = llama.RULES     # the QKV bias is Llama's optional rule, present here
    always_qkv_bias = True

    def init_tiny(self, model) -> None:
        """The QKV bias drawn away from transformers' zeros, so a conversion bug in it shows."""
        import torch
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.02)


FAMILY = Qwen2()
