"""Qwen3-MoE (`qwen3_moe`, Qwen3-30B-A3B's layout): Qwen3's attention, and in every layer a router (HF
mlp.gate) over num_experts SwiGLU experts of moe_intermediate_size each, no shared expert.

The config also carries a dense intermediate_size, which only dense layers (mlp_only_layers,
decoder_sparse_step > 1) would use; the learner builds every layer as an MoE layer and refuses
configs with dense ones, so nothing here splits that width (ModelShape.mlp_width).
"""

from __future__ import annotations

from megatron_specrl.models.families import llama, qwen3
from megatron_specrl.models.families.base import HF_LAYER, LAYER, Rule
from megatron_specrl.models.families.qwen3 import Qwen3

# "{e}" is the global expert index, written once per expert by hf_mapping.get_mapping.
_EXPERT = LAYER + "mlp.experts.local_experts.{e}."
_HF_EXPERT = HF_LAYER + "mlp.experts.{e}."
EXPERTS = (
    Rule(LAYER + "mlp.router.weight", (HF_LAYER + "mlp.gate.weight",), "rep", hf_shapes=(("E", "H"),)),
    Rule(_EXPERT + "linear_fc1.weight", (_HF_EXPERT + "gate_proj.weight", _HF_EXPERT + "up_proj.weight"), "fc1",
         hf_shapes=(("FE", "H"), ("FE", "H"))),
    Rule(_EXPERT + "linear_fc2.weight", (_HF_EXPERT + "down_proj.weight",), "row", hf_shapes=(("H", "FE"),)),
)
RULES = (llama.EMBEDDING, *qwen3.ATTENTION, llama.MLP_NORM, *EXPERTS, llama.FINAL_NORM, llama.OUTPUT)


class Qwen3Moe(Qwen3):
    model_type = "qwen3_moe"
    tiny_name = "tiny-qwen3-moe"
    # Qwen3-30B-A3B's layout in small: every layer MoE, 8 experts, top-2 renormalised, untied.
    tiny_config = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                       intermediate_size=256, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                       norm_topk_prob=True, router_aux_loss_coef=0.001, decoder_sparse_step=1, mlp_only_layers=[],
                       tie_word_embeddings=False)
    rules = RULES
    moe = True

    def _shape_fields(self, hf) -> dict:
        return dict(super()._shape_fields(hf), experts=hf.num_experts, expert_ffn=hf.moe_intermediate_size,
                    topk=hf.num_experts_per_tok)

    def unsupported(self, hf) -> list[str]:
        """Fields the learner's all-MoE layers would not honour."""
        out = super().unsupported(hf)
        step = getattr(hf, "decoder_sparse_step", 1)
        if step != 1:
            out.append(f"decoder_sparse_step={step} is not supported: the learner builds every layer as an MoE "
                       "layer (decoder_sparse_step=1)")
        if list(getattr(hf, "mlp_only_layers", None) or []):
            out.append(f"mlp_only_layers={list(hf.mlp_only_layers)} is not supported: the learner builds every "
                       "layer as an MoE layer")
        if getattr(hf, "shared_expert_intermediate_size", 0):
            out.append("shared experts are not supported (Qwen3-MoE has none)")
        return out

    def moe_settings(self, hf) -> dict:
        """HF Qwen3-MoE routes by a softmax over all experts in fp32, keeps the top num_experts_per_tok and
        renormalises them when norm_topk_prob: Megatron's softmax after the top-k gives the same weights,
        its softmax before the top-k (pre_softmax) the unrenormalised ones. router_aux_loss_coef is the
        load-balancing loss's coefficient (0: none). Experts are SequentialMLPs (grouped GEMM off: the
        mapping names each expert's linears) behind the alltoall dispatcher."""
        coef = float(getattr(hf, "router_aux_loss_coef", 0.0) or 0.0)
        return dict(
            num_moe_experts=hf.num_experts,
            moe_ffn_hidden_size=hf.moe_intermediate_size,
            moe_router_topk=hf.num_experts_per_tok,
            moe_router_pre_softmax=not bool(getattr(hf, "norm_topk_prob", False)),
            moe_router_score_function="softmax",
            moe_router_load_balancing_type="aux_loss" if coef else "none",
            moe_aux_loss_coeff=coef,
            moe_router_dtype="fp32",
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=False,
        )


FAMILY = Qwen3Moe()
