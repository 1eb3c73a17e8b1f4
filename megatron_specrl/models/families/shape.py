"""A model's shape, read from its HF config by its family, and the one rule for which parallel layouts fit it.

`layout_failures` is the rule every entry point checks a layout with before anything starts: the
plan check (`train --dry-run`, `launch`, `train` itself), the run's start-up check (`train(cfg)` called
from Python), `convert` and `check-resync`. Each names its sizes its own way (learner.tp, --tp:
LayoutKeys), the rule and the wording are this module's. Four hand-written copies of it disagreed
before: for a Qwen3-MoE model the plan and `convert` split each expert's moe_intermediate_size over
TP, while the start-up check and `check-resync` split the dense intermediate_size that no layer of
the model uses (refusing a model that runs, and letting through one that fails inside Megatron).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """What the plan, the layout rule and the mapping need from an HF config.json (its family reads it)."""
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool
    max_positions: int
    qk_norm: bool = False    # Qwen3: an RMSNorm over each head's q and one over each k (head_dim weights each)
    experts: int = 0         # routed experts of every layer's MoE MLP (0: a dense SwiGLU MLP of width ffn)
    expert_ffn: int = 0      # each expert's SwiGLU width (moe_intermediate_size)
    topk: int = 0            # experts each token is routed to (num_experts_per_tok)

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def mlp_width(self) -> tuple[str, int]:
        """(config field, value) of the width TP splits in the MLP: intermediate_size, or each expert's
        moe_intermediate_size (Megatron's expert TP is the TP size; vLLM's fused MoE splits it too). An MoE
        config's dense intermediate_size belongs to no layer the learner builds."""
        return ("moe_intermediate_size", self.expert_ffn) if self.moe else ("intermediate_size", self.ffn)

    @property
    def dims(self) -> dict[str, int]:
        """The dimensions mapping rules give HF tensor shapes in (families/base.Rule.hf_shapes)."""
        return {"H": self.hidden, "Q": self.heads * self.head_dim, "KV": self.kv_heads * self.head_dim,
                "D": self.head_dim, "F": self.ffn, "FE": self.expert_ffn, "E": self.experts, "V": self.vocab}

    @classmethod
    def from_hf(cls, hf) -> ModelShape:
        """The shape of an HF config (transformers' AutoConfig), as its family reads it. A model_type no
        family covers is read as a plain dense decoder, so the plan can still size it while the model
        builder's check (model_provider.check_hf_config) refuses it in a line of its own."""
        from megatron_specrl.models.families import DENSE_DECODER, FAMILIES
        return FAMILIES.get(hf.model_type, DENSE_DECODER).shape(hf)


@dataclass(frozen=True)
class LayoutKeys:
    """How an entry point names its parallel sizes in a failure line."""
    tp: str = "learner.tp"
    pp: str = "learner.pp"
    ep: str = "learner.ep"
    engine_tp: str = "rollout.engine_tp"


RUN_KEYS = LayoutKeys()                                   # a run's config: the plan, the start-up check
CLI_KEYS = LayoutKeys("--tp", "--pp", "--ep", "--engine-tp")   # convert, check-resync


def layout_failures(s: ModelShape, *, where: str, tp: int = 1, pp: int = 1, ep: int | None = 1,
                    engine_tp: int | None = None, keys: LayoutKeys = RUN_KEYS) -> list[str]:
    """One line per parallel size that does not fit the model (empty: the layout fits); `where` names the
    model ("model.path='...'", a directory). The sizes a caller does not have are None.

    - TP (the learner's, and the engines') splits the attention heads, the KV heads (Megatron splits the
      query groups) and the MLP's width, `s.mlp_width`: intermediate_size, or an MoE model's
      moe_intermediate_size (each expert is split over the expert TP size, Megatron's default: TP).
      An engine TP may instead be a multiple of the KV heads: vLLM and SGLang replicate them.
    - PP splits the layers.
    - EP splits an MoE model's experts; a dense model has none to split.
    Otherwise the layout fails inside a Megatron or vLLM assert on a rank, after the model is built,
    naming no config field."""
    sizes = ((keys.tp, tp), (keys.pp, pp), (keys.ep, ep), (keys.engine_tp, engine_tp))
    small = [f"{key}={size}" for key, size in sizes if size is not None and size < 1]
    if small:
        return [" / ".join(small) + ": parallel sizes must be >= 1"]
    out = []
    width_field, width = s.mlp_width
    for key, size, replicates_kv in ((keys.tp, tp, False), (keys.engine_tp, engine_tp, True)):
        if size is None:
            continue
        bad = [f"num_attention_heads={s.heads}"] if s.heads % size else []
        if s.kv_heads % size and not (replicates_kv and size % s.kv_heads == 0):
            bad.append(f"num_key_value_heads={s.kv_heads}")
        if width % size:
            bad.append(f"{width_field}={width}")
        if bad:
            out.append(f"{key}={size} does not divide {' and '.join(bad)} of {where}")
    if pp is not None and s.layers % pp:
        out.append(f"{keys.pp}={pp} does not divide num_hidden_layers={s.layers} of {where}")
    if ep is not None and ep > 1 and not s.moe:
        out.append(f"{keys.ep}={ep}: {where} is a dense model ({s.model_type}, no experts to split); "
                   f"use {keys.ep}=1")
    elif ep is not None and s.moe and s.experts % ep:
        out.append(f"{keys.ep}={ep} does not divide num_experts={s.experts} of {where}")
    return out
