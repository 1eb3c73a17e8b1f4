"""Llama (`llama`, Llama 3 / 3.1 / 3.2 / 3.3): GQA, SwiGLU, an untied or tied head, Llama 3.1's RoPE scaling.

Its tensor names are the base every other family here extends (Qwen2 uses them as they are).
"""

from __future__ import annotations

from megatron_specrl.models.families.base import HF_LAYER, LAYER, Family, Rule

EMBEDDING = Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", hf_shapes=(("V", "H"),))
INPUT_NORM = Rule(LAYER + "input_layernorm.weight", (HF_LAYER + "input_layernorm.weight",), "rep",
                  hf_shapes=(("H",),))
QKV = Rule(LAYER + "self_attention.linear_qkv.weight", tuple(HF_LAYER + f"self_attn.{p}_proj.weight" for p in "qkv"),
           "qkv", hf_shapes=(("Q", "H"), ("KV", "H"), ("KV", "H")))
QKV_BIAS = Rule(LAYER + "self_attention.linear_qkv.bias", tuple(HF_LAYER + f"self_attn.{p}_proj.bias" for p in "qkv"),
                "qkv", optional=True, hf_shapes=(("Q",), ("KV",), ("KV",)))
ATTENTION_OUT = Rule(LAYER + "self_attention.linear_proj.weight", (HF_LAYER + "self_attn.o_proj.weight",), "row",
                     hf_shapes=(("H", "Q"),))
MLP_NORM = Rule(LAYER + "pre_mlp_layernorm.weight", (HF_LAYER + "post_attention_layernorm.weight",), "rep",
                hf_shapes=(("H",),))
MLP = (
    Rule(LAYER + "mlp.linear_fc1.weight", (HF_LAYER + "mlp.gate_proj.weight", HF_LAYER + "mlp.up_proj.weight"), "fc1",
         hf_shapes=(("F", "H"), ("F", "H"))),
    Rule(LAYER + "mlp.linear_fc2.weight", (HF_LAYER + "mlp.down_proj.weight",), "row", hf_shapes=(("H", "F"),)),
)
FINAL_NORM = Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "rep", hf_shapes=(("H",),))
OUTPUT = Rule("output_layer.weight", ("lm_head.weight",), "vocab", hf_shapes=(("V", "H"),))

ATTENTION = (INPUT_NORM, QKV, QKV_BIAS, ATTENTION_OUT)   # the QKV bias rule applies where the family has one
RULES = (EMBEDDING, *ATTENTION, MLP_NORM, *MLP, FINAL_NORM, OUTPUT)


class Llama(Family):
    model_type = "llama"
    tiny_name = "tiny-llama"
    # GQA, untied embeddings, no QKV bias. vLLM's CPU attention needs head_dim >= 32: hidden 128 over 4 heads.
    tiny_config = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
                       tie_word_embeddings=False)
    rules = RULES


FAMILY = Llama()
