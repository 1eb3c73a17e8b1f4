"""What every model family answers, and the HF <-> Megatron mapping rule its name table is made of.

A family (llama.py, qwen2.py, qwen3.py, qwen3_moe.py; the registry in __init__.py) is the one place
that knows, for its `model_type`:
  - the shape its HF config.json gives (`shape`: heads, KV heads, head_dim, the MLP or each expert's
    width, experts, vocabulary, layers, positions, tied head), which the plan, the layout rule
    (shape.layout_failures) and the mapping's tensor shapes read;
  - the Megatron layer-spec settings the learner builds it with (`layer_settings`: QK layernorm, QKV
    bias; `moe_settings`: the router and experts);
  - its HF <-> Megatron name table (`rules`: q / k norm names, router and expert names, biases);
  - the config fields it refuses (`unsupported`), beyond those the learner refuses for every family;
  - its tiny model (`tiny_name`, `tiny_config`, `init_tiny`), built from a seed by models/tiny.py.
Before, plan.py, learner/hf_mapping.py, learner/model_provider.py and models/tiny.py each kept a
model_type table of their own, and they drifted: the plan split an MoE model's expert width over TP
while the run's start-up check split the dense intermediate_size.

This module imports neither torch nor transformers: the plan check reads shapes without them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megatron_specrl.models.families.shape import ModelShape


@dataclass(frozen=True)
class Rule:
    """Which Megatron parameter holds which HF tensors, how it splits over TP, and the HF tensors' shapes.

    kinds (learner/hf_mapping.py splits and merges them):
      vocab   split dim 0 after padding the vocabulary with zero rows (embedding, output layer)
      col     split dim 0 (column-parallel)
      row     split dim 1 (row-parallel: linear_proj, linear_fc2)
      rep     replicated (norms, the router)
      qkv     q/k/v interleaved per query group [q_heads_of_group; k; v], groups split over TP
      fc1     SwiGLU: each TP rank holds [gate_r; up_r] (a chunk of the gathered tensor is NOT this)
    `hf_shapes` gives each HF tensor's shape in ModelShape's dimensions (ModelShape.dims: H hidden, Q
    heads x head_dim, KV kv_heads x head_dim, D head_dim, F intermediate_size, FE moe_intermediate_size,
    E experts, V vocab), so the tensors a checkpoint must hold follow from the same table as the mapping.
    """
    megatron: str                           # stage-local Megatron name; "{i}" = local layer, "{e}" = expert
    hf: tuple[str, ...]                     # HF names; "{i}" = global layer index, "{e}" = global expert
    kind: str                               # vocab | col | row | rep | qkv | fc1
    optional: bool = False                  # present only for some configs (QKV bias)
    hf_shapes: tuple[tuple[str, ...], ...] = ()


LAYER = "decoder.layers.{i}."      # a Megatron layer's prefix (stage-local index)
HF_LAYER = "model.layers.{i}."     # an HF layer's prefix (global index)


class Family:
    """The questions the rest of the code asks about a model family, with the answers of a plain
    dense decoder (Llama's, without its table). A subclass per family overrides what differs; the
    base instance itself reads a config of an unsupported model_type, so the plan can still size it
    while check_hf_config refuses it in its own line."""

    model_type: ClassVar[str] = ""
    tiny_name: ClassVar[str] = ""          # model.path of its tiny model (models/resolve.TINY)
    tiny_config: ClassVar[dict] = {}       # the tiny model's HF config fields beside the shared ones (tiny.py)
    rules: ClassVar[tuple[Rule, ...]] = ()
    qk_norm: ClassVar[bool] = False        # an RMSNorm over each head's q and one over each k (head_dim weights each)
    always_qkv_bias: ClassVar[bool] = False   # q / k / v biased whatever the config says (Qwen2)
    moe: ClassVar[bool] = False            # every layer's MLP is a router and routed experts

    def qkv_bias(self, hf) -> bool:
        """Whether q / k / v carry a bias: the family's own (Qwen2), else the config's attention_bias (which
        `unsupported` refuses where HF would then bias o_proj too)."""
        return self.always_qkv_bias or bool(getattr(hf, "attention_bias", False))

    def shape(self, hf) -> ModelShape:
        """The shape of a dense model: what the plan, the layout rule and the mapping read."""
        return ModelShape(**self._shape_fields(hf))

    def _shape_fields(self, hf) -> dict:
        heads = hf.num_attention_heads
        return dict(model_type=hf.model_type, hidden=hf.hidden_size, layers=hf.num_hidden_layers, heads=heads,
                    kv_heads=hf.num_key_value_heads or heads,
                    head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,   # Qwen3 sets its own
                    ffn=hf.intermediate_size, vocab=hf.vocab_size,
                    tied=bool(getattr(hf, "tie_word_embeddings", False)), qkv_bias=self.qkv_bias(hf),
                    max_positions=hf.max_position_embeddings, qk_norm=self.qk_norm)

    def unsupported(self, hf) -> list[str]:
        """One line per config field of this family that the learner's model would not honour."""
        if not self.always_qkv_bias and getattr(hf, "attention_bias", False):
            return [f"attention_bias=true is not supported: HF {hf.model_type} then biases q/k/v and o_proj, "
                    "Megatron's add_qkv_bias covers q/k/v only"]
        return []

    def layer_settings(self, hf) -> dict:
        """TransformerConfig fields this family decides (the rest are the same for every family)."""
        return dict(add_qkv_bias=self.qkv_bias(hf), qk_layernorm=self.qk_norm)

    def moe_settings(self, hf) -> dict:
        """TransformerConfig fields of the router and experts ({} for a dense family); the learner adds
        its parallel sizes (model_provider.moe_settings)."""
        return {}

    def init_tiny(self, model) -> None:
        """Weights of the tiny model set away from transformers' defaults after its seeded initialisation,
        where a mapping bug would otherwise not show (a zero bias, a norm of ones)."""
