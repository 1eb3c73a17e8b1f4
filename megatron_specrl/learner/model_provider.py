"""Build a Megatron GPTModel from a Hugging Face config (Llama, Qwen2, Qwen3 and Qwen3-MoE families).

CPU: local spec (plain torch modules) with every fusion off; GPU: the
TransformerEngine spec when TE is importable. Vocab is padded like Megatron
does (multiple of `divisible_by * tp`); padded logits are masked in logprobs.
What differs by family (QK layernorm, QKV bias, the router and experts, the
fields refused) its module in models/families/ says; this module builds any of them.
"""

from __future__ import annotations

import torch

from megatron_specrl.models.families import UnsupportedModelType, family_of
from megatron_specrl.models.families.shape import ModelShape, layout_failures


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Smallest multiple of divisible_by * tp that holds the vocabulary."""
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


def rope_theta(hf_config) -> float:
    theta = getattr(hf_config, "rope_theta", None)
    if theta is None:  # transformers >= 5 moves it into rope_parameters
        params = getattr(hf_config, "rope_parameters", None) or {}
        theta = params.get("rope_theta", 10000.0)
    return float(theta)


def unsupported_fields(hf_config) -> list[str]:
    """One line per field of the config that HF honours and the Megatron model built here would not (an
    unsupported model_type alone, when it is one): refused rather than computing something else. The
    plan reports every line; check_hf_config raises the first."""
    try:
        family = family_of(hf_config)
    except UnsupportedModelType as e:
        return [str(e)]
    out = []
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        out.append(f"only SwiGLU (hidden_act=silu) is supported, got {hf_config.hidden_act!r}")
    out += family.unsupported(hf_config)
    if getattr(hf_config, "mlp_bias", False):
        out.append("mlp_bias=true is not supported (the converter builds bias-free MLPs)")
    if getattr(hf_config, "use_sliding_window", False):
        out.append("use_sliding_window=true is not supported (the learner attends over the full sequence)")
    params = getattr(hf_config, "rope_parameters", None) or {}
    partial = getattr(hf_config, "partial_rotary_factor", None) or params.get("partial_rotary_factor", 1.0)
    if float(partial) != 1.0:
        out.append(f"partial_rotary_factor={partial} is not supported (RoPE on the whole head_dim only)")
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    kind = scaling.get("rope_type", scaling.get("type")) or params.get("rope_type", "default")
    if kind == "llama3":
        try:
            llama3_rope_factor(hf_config)   # raises unless Megatron's fixed Llama 3.1 constants match
        except ValueError as e:
            out.append(str(e))
    elif kind not in (None, "default"):
        out.append(f"rope_scaling rope_type={kind!r} is not supported by the converter (only llama3)")
    return out


def check_hf_config(hf_config) -> None:
    """Raise ValueError with the first of unsupported_fields (the model builder's and convert's check)."""
    lines = unsupported_fields(hf_config)
    if lines:
        raise ValueError(lines[0])


def moe_settings(hf_config, ep: int = 1, aux_loss_scale: float = 1.0, tp: int = 1) -> dict:
    """TransformerConfig fields of an MoE model (empty for a dense one): the family's router and experts
    (its moe_settings says how they match HF's) with the learner's parallel sizes. `aux_loss_scale`
    scales router_aux_loss_coef: the AdamW path sums gradients over DP ranks, so it passes 1/dp to keep
    the load-balancing term the mean Megatron's DDP gives."""
    family = family_of(hf_config)
    if not family.moe:
        return {}
    routing = family.moe_settings(hf_config)
    return dict(
        routing,
        moe_aux_loss_coeff=routing["moe_aux_loss_coeff"] * aux_loss_scale,
        expert_model_parallel_size=ep,
        # Megatron trains MoE with TP only under sequence parallelism (MoELayer refuses otherwise)
        sequence_parallel=tp > 1,
    )


# Megatron's RotaryEmbedding applies Llama 3.1's RoPE scaling with these constants fixed; only the
# factor is a GPTModel argument (megatron/core/models/common/embeddings/rotary_pos_embedding.py).
MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def llama3_rope_factor(hf_config) -> float | None:
    """The llama3 RoPE scaling factor (Llama 3.1 / 3.2 / 3.3), None without llama3 scaling; raises when
    the config's constants differ from the ones Megatron hard-codes."""
    scaling = dict(getattr(hf_config, "rope_scaling", None) or getattr(hf_config, "rope_parameters", None) or {})
    if scaling.get("rope_type", scaling.get("type")) != "llama3":
        return None
    for key, want in MEGATRON_LLAMA3_ROPE.items():
        if float(scaling.get(key, want)) != want:
            raise ValueError(f"llama3 RoPE scaling with {key}={scaling.get(key)}: Megatron fixes it at {want:g}")
    return float(scaling["factor"])


# learner.recompute -> Megatron's activation recomputation settings: selective recomputes the attention
# core, full recomputes each layer from its input in the backward pass. GPU only: Megatron's checkpoint
# saves and restores CUDA RNG states, which a CPU build of torch does not have.
RECOMPUTE = {
    "none": {},
    "selective": {"recompute_granularity": "selective"},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
}


def transformer_config_from_hf(hf_config, tp: int = 1, pp: int = 1, dtype: torch.dtype = torch.float32,
                               use_cpu: bool | None = None, recompute: str = "none", ep: int = 1,
                               aux_loss_scale: float = 1.0):
    """TransformerConfig equivalent to the HF model (RMSNorm, SwiGLU, GQA, RoPE, no linear bias), with
    what its family decides (QK layernorm, QKV bias; Qwen3-MoE: routed experts split over `ep` ranks, expert
    TP = tp). The layout is checked here too, with the rule the entry points checked before the ranks
    started (shape.layout_failures), for a caller that skipped them."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    check_hf_config(hf_config)
    family, s = family_of(hf_config), ModelShape.from_hf(hf_config)
    failures = layout_failures(s, where="the model", tp=tp, pp=pp, ep=ep)
    if failures:
        raise ValueError("; ".join(failures))
    cpu = (not torch.cuda.is_available()) if use_cpu is None else use_cpu
    if recompute != "none" and not torch.cuda.is_available():
        raise ValueError(f"learner.recompute={recompute} needs CUDA: Megatron's activation checkpointing "
                         "saves CUDA RNG states; use learner.recompute=none on CPU")
    return TransformerConfig(
        num_layers=s.layers,
        hidden_size=s.hidden,
        ffn_hidden_size=s.ffn,
        num_attention_heads=s.heads,
        num_query_groups=s.kv_heads,
        kv_channels=s.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=cpu,
        # Fusions need CUDA kernels (apex / TE); the local spec runs unfused.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        # Microbatches may differ in shape (dynamic batching); p2p sends shapes first.
        variable_seq_lengths=True,
        # the alltoall dispatcher for MoE ("allgather" rejects variable sequence lengths), on gloo too
        moe_token_dispatcher_type="alltoall",
        batch_p2p_comm=True,
        batch_p2p_sync=not cpu,  # the sync is torch.cuda.synchronize()
        deallocate_pipeline_outputs=False,
        **RECOMPUTE[recompute],
        **family.layer_settings(hf_config),   # add_qkv_bias, qk_layernorm
        **{k: v for k, v in moe_settings(hf_config, ep, aux_loss_scale, tp).items()
           if k != "moe_token_dispatcher_type"},
    )


def _layer_spec(use_te: bool, config):
    """The local spec (CPU) or TransformerEngine's; MoE layers use SequentialMLP experts on both
    (grouped GEMM off: hf_mapping names each expert's linears)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    moe = dict(num_experts=config.num_moe_experts, moe_grouped_gemm=False, qk_layernorm=config.qk_layernorm)
    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(**moe)
    return specs.get_gpt_layer_local_spec(normalization="RMSNorm", **moe)


def te_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
        return True
    except ImportError:
        return False


class ValueHead(torch.nn.Module):
    """Scalar head for the PPO critic; replicated across TP (its input is already reduced)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        return torch.nn.functional.linear(hidden_states, self.weight), None


ROLES = ("policy", "critic", "reference")   # reference: a frozen policy (the KL anchor), never trained


def build_gpt_model(hf_config, tp: int = 1, pp: int = 1, dtype: torch.dtype = torch.float32,
                    pre_process: bool | None = None, post_process: bool | None = None,
                    role: str = "policy", vocab_divisible_by: int = 128, use_te: bool | None = None,
                    recompute: str = "none", ep: int = 1, aux_loss_scale: float = 1.0):
    """GPTModel for this rank's pipeline stage (parallel_state must be initialised)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    from megatron_specrl.learner.parallel import apply_cpu_patches
    apply_cpu_patches()
    config = transformer_config_from_hf(hf_config, tp, pp, dtype, recompute=recompute, ep=ep,
                                        aux_loss_scale=aux_loss_scale)
    if pre_process is None:
        pre_process = ps.is_pipeline_first_stage()
    if post_process is None:
        post_process = ps.is_pipeline_last_stage()
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    # The reference is a frozen copy of the policy: the same architecture, LM head included.
    tied = bool(getattr(hf_config, "tie_word_embeddings", False)) and role != "critic"
    model = GPTModel(
        config=config,
        transformer_layer_spec=_layer_spec(te_available() if use_te is None else use_te, config),
        vocab_size=padded_vocab_size(hf_config.vocab_size, tp, vocab_divisible_by),
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=tied,
        position_embedding_type="rope",
        rotary_base=rope_theta(hf_config),
        rope_scaling=llama3_rope_factor(hf_config) is not None,
        rope_scaling_factor=llama3_rope_factor(hf_config) or 8.0,
    )
    if role == "critic" and post_process:
        model.output_layer = ValueHead(hf_config.hidden_size, dtype)
    model.true_vocab_size = hf_config.vocab_size
    model.role = role
    return model
