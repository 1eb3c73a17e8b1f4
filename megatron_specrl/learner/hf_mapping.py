"""HF <-> Megatron-core weight mapping for the Llama, Qwen2, Qwen3 and Qwen3-MoE families (pure torch).

Each family's declarative table (models/families/<family>.py, `Family.rules`; the Rule kinds are
described in models/families/base.py) says which Megatron parameter holds which HF tensors, how it is
split across tensor-parallel ranks and the HF tensors' shapes; this module splits, merges and checks
by those tables and knows no family by name.

Megatron names are stage-local: every pipeline stage numbers its layers from 0.
Experts (Qwen3-MoE) are named here by their global index, as on one expert-parallel rank: an
EP rank's model numbers its local experts from 0, and `ep_local` / `ep_global_name` translate
between the two (expert e lives on EP rank e // (num_experts / ep)). Megatron's expert tensor
parallel size is the TP size, so an expert's fc1 / fc2 split over TP like a dense MLP's.
A deliberately wrong table, `miswired(table, MISWIRINGS["swap_kv"])`, lets the resync checker
prove it detects a wrong mapping: the one injected thing is a renaming of HF module names
(`swap_experts` trades experts 0 and 1 of every MoE layer).
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch
from torch import Tensor

from megatron_specrl.models.families import UnsupportedModelType, family_of
from megatron_specrl.models.families.base import Rule
from megatron_specrl.models.families.shape import ModelShape


class CheckpointError(ValueError):
    """A checkpoint does not fit the model; the message names the tensor."""


# The TransformerEngine spec fuses the pre-norms into the following linear.
TE_RENAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


def local_param_name(name: str, available) -> str:
    """The model's own name for a local-spec parameter name: under the TransformerEngine spec the
    layernorms are fused into the following linear (TE_RENAMES)."""
    if name in available:
        return name
    for local_suffix, te_suffix in TE_RENAMES.items():
        if name.endswith(local_suffix) and name[: -len(local_suffix)] + te_suffix in available:
            return name[: -len(local_suffix)] + te_suffix
    raise KeyError(f"model has no parameter {name!r} (nor its TransformerEngine name)")


# ----------------------------------------------------------------------------- config helpers
def _shape(cfg) -> ModelShape:
    return ModelShape.from_hf(cfg)


def _tied(cfg) -> bool:
    return _shape(cfg).tied


def _has_qkv_bias(cfg) -> bool:
    return _shape(cfg).qkv_bias


def padded_vocab(cfg, tp: int, divisible_by: int = 128) -> int:
    m = divisible_by * tp
    return ((cfg.vocab_size + m - 1) // m) * m


# Debug wirings for the resync checker: HF module names written in place of others (a key with a
# dot renames that run of dotted parts, e.g. experts.0).
MISWIRINGS = {"swap_kv": {"k_proj": "v_proj", "v_proj": "k_proj"},
              "swap_gate_up": {"gate_proj": "up_proj", "up_proj": "gate_proj"},
              "swap_experts": {"experts.0": "experts.1", "experts.1": "experts.0"}}


def _rename_parts(name: str, renames: dict[str, str]) -> str:
    parts = name.split(".")
    out, i = [], 0
    while i < len(parts):
        for old, new in renames.items():
            n = old.count(".") + 1
            if ".".join(parts[i:i + n]) == old:
                out.extend(new.split("."))
                i += n
                break
        else:
            out.append(parts[i])
            i += 1
    return ".".join(out)


def miswired(mapping, renames: dict[str, str] | None) -> tuple[Rule, ...]:
    """`mapping` with each HF name's module parts renamed (e.g. k_proj <-> v_proj): every tensor
    then travels under the other's name, a wrong mapping that a correct checker must catch."""
    if not renames:
        return tuple(mapping)
    return tuple(replace(r, hf=tuple(_rename_parts(n, renames) for n in r.hf)) for r in mapping)


def _expand_experts(mapping, cfg) -> tuple[Rule, ...]:
    """Rules with "{e}" written once per expert (global index), the other rules as they are."""
    out = []
    for r in mapping:
        if "{e}" not in r.megatron:
            out.append(r)
            continue
        for e in range(_shape(cfg).experts):
            out.append(replace(r, megatron=r.megatron.replace("{e}", str(e)),
                               hf=tuple(n.replace("{e}", str(e)) for n in r.hf)))
    return tuple(out)


def get_mapping(cfg, mapping=None) -> tuple[Rule, ...]:
    """The config's family's table (or `mapping`, a custom one) with each expert rule written per expert."""
    if mapping is not None:
        return _expand_experts(mapping, cfg)
    try:
        family = family_of(cfg)
    except UnsupportedModelType as e:
        raise CheckpointError(f"no HF<->Megatron mapping: {e}") from None
    return _expand_experts(family.rules, cfg)


# ----------------------------------------------------------------------------- expert parallelism
_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")
# TransformerEngine's grouped-GEMM experts (moe_grouped_gemm): mlp.experts.linear_fc1.weight<j>
_GROUPED_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)(linear_fc[12]\.weight)(\d+)$")


def expert_index(name: str) -> int | None:
    """The expert number in a Megatron expert parameter's name (local spec or grouped GEMM), else None."""
    m = _LOCAL_EXPERT.match(name)
    if m:
        return int(m.group(2))
    m = _GROUPED_EXPERT.match(name)
    return int(m.group(3)) if m else None


def grouped_to_local_name(name: str) -> str:
    """mlp.experts.linear_fc1.weight3 (grouped GEMM) -> mlp.experts.local_experts.3.linear_fc1.weight."""
    m = _GROUPED_EXPERT.match(name)
    return f"{m.group(1)}local_experts.{m.group(3)}.{m.group(2)}" if m else name


def _with_expert(name: str, e: int) -> str:
    m = _LOCAL_EXPERT.match(name)
    return f"{m.group(1)}{e}{m.group(3)}"


def experts_per_rank(cfg, ep: int) -> int:
    n = _shape(cfg).experts
    if n % ep:
        raise CheckpointError(f"learner.ep={ep} does not divide num_experts={n}")
    return n // ep


def expert_owner(name: str, cfg, ep: int) -> int | None:
    """The EP rank holding a globally named expert parameter (None: not an expert parameter)."""
    e = expert_index(name)
    return None if e is None else e // experts_per_rank(cfg, ep)


def ep_local(tensors: dict[str, Tensor], cfg, ep: int, ep_rank: int) -> dict[str, Tensor]:
    """Globally named tensors -> one EP rank's: its experts, renumbered from 0; the rest as they are."""
    if ep == 1:
        return dict(tensors)
    n = experts_per_rank(cfg, ep)
    out = {}
    for name, t in tensors.items():
        e = expert_index(name)
        if e is None:
            out[name] = t
        elif e // n == ep_rank:
            out[_with_expert(name, e - ep_rank * n)] = t
    return out


def ep_global_name(name: str, cfg, ep: int, ep_rank: int) -> str:
    """An EP rank's local expert parameter name -> its global name (other names unchanged)."""
    name = grouped_to_local_name(name)
    e = expert_index(name)
    return name if e is None or ep == 1 else _with_expert(name, ep_rank * experts_per_rank(cfg, ep) + e)


def ep_local_name(name: str, cfg, ep: int) -> str:
    """A globally named expert parameter -> its name on the EP rank that owns it."""
    e = expert_index(name)
    return name if e is None or ep == 1 else _with_expert(name, e % experts_per_rank(cfg, ep))


def expected_hf_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Every HF tensor the model needs, with its shape (lm_head only when untied): the family's table on
    one pipeline stage (stage_rules: the QKV bias where the model has one), each rule's hf_shapes in the
    model's dimensions."""
    dims = _shape(cfg).dims
    out = {}
    for rule, _, g in stage_rules(cfg, get_mapping(cfg), 1, 0):
        for name, shape in zip(rule.hf, rule.hf_shapes, strict=True):
            out[name.format(i=g)] = tuple(dims[d] for d in shape)
    return out


def validate_hf_state(hf_state: dict[str, Tensor], cfg) -> None:
    """Raise CheckpointError naming the first missing, mis-shaped or unexpected tensor."""
    expected = expected_hf_shapes(cfg)
    for name, shape in expected.items():
        if name not in hf_state:
            raise CheckpointError(f"checkpoint is missing tensor {name!r} (expected shape {list(shape)})")
        # a lazily read checkpoint (hf_checkpoint.HFCheckpoint) has the shapes from its headers
        got = tuple(hf_state.shape(name)) if hasattr(hf_state, "shape") else tuple(hf_state[name].shape)
        if got != shape:
            if name in ("model.embed_tokens.weight", "lm_head.weight") and got[1:] == shape[1:]:
                raise CheckpointError(f"vocab mismatch: tensor {name!r} has {got[0]} rows but "
                                      f"config vocab_size={cfg.vocab_size}")
            raise CheckpointError(f"tensor {name!r} has shape {list(got)}, expected {list(shape)}")
    for name in hf_state:
        if name not in expected and not name.endswith(IGNORED_HF_SUFFIXES):
            if name == "lm_head.weight" and _tied(cfg):
                continue  # some tied checkpoints store the head too
            raise CheckpointError(f"unexpected tensor {name!r} in checkpoint (model_type={cfg.model_type}, "
                                  f"num_hidden_layers={cfg.num_hidden_layers})")


# ----------------------------------------------------------------------------- split / merge
def _qkv_full(q: Tensor, k: Tensor, v: Tensor, cfg) -> Tensor:
    """[q; k; v] (HF) -> per query group [q_g; k_g; v_g] (Megatron), for weights or biases."""
    s = _shape(cfg)
    nkv, hd = s.kv_heads, s.head_dim
    qpg = s.heads // nkv
    rest = q.shape[1:]
    qg = q.reshape(nkv, qpg * hd, *rest)
    kg = k.reshape(nkv, hd, *rest)
    vg = v.reshape(nkv, hd, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest)


def _qkv_split(full: Tensor, cfg) -> tuple[Tensor, Tensor, Tensor]:
    s = _shape(cfg)
    nkv, hd = s.kv_heads, s.head_dim
    qpg = s.heads // nkv
    rest = full.shape[1:]
    g = full.reshape(nkv, (qpg + 2) * hd, *rest)
    q = g[:, : qpg * hd].reshape(-1, *rest)
    k = g[:, qpg * hd: (qpg + 1) * hd].reshape(-1, *rest)
    v = g[:, (qpg + 1) * hd:].reshape(-1, *rest)
    return q.contiguous(), k.contiguous(), v.contiguous()


def split_for_tp(rule: Rule, hf_tensors: list[Tensor], cfg, tp: int, vocab_divisible_by: int = 128) -> list[Tensor]:
    """Full HF tensor(s) of one rule -> the tp local Megatron shards."""
    kind = rule.kind
    if kind == "rep":
        return [hf_tensors[0].clone() for _ in range(tp)]
    if kind == "vocab":
        w = hf_tensors[0]
        pad = padded_vocab(cfg, tp, vocab_divisible_by) - w.shape[0]
        if pad:
            w = torch.cat([w, w.new_zeros(pad, *w.shape[1:])], dim=0)
        return [c.clone() for c in torch.chunk(w, tp, dim=0)]
    if kind == "col":
        return [c.clone() for c in torch.chunk(hf_tensors[0], tp, dim=0)]
    if kind == "row":
        return [c.clone() for c in torch.chunk(hf_tensors[0], tp, dim=1)]
    if kind == "qkv":  # query groups are contiguous, so a dim-0 chunk gives each rank its groups
        full = _qkv_full(*hf_tensors, cfg)
        return [c.clone() for c in torch.chunk(full, tp, dim=0)]
    if kind == "fc1":
        gate, up = hf_tensors
        return [torch.cat([g, u], dim=0) for g, u in zip(torch.chunk(gate, tp, 0), torch.chunk(up, tp, 0))]
    raise ValueError(f"unknown split kind {kind!r}")


def _local_to_rule(name: str, mapping) -> tuple[Rule, int | None]:
    """Match a stage-local Megatron name (local or TE spec) to its rule and local layer index."""
    for old_suffix, te_suffix in TE_RENAMES.items():
        if name.endswith(te_suffix):
            name = name[: -len(te_suffix)] + old_suffix
    name = grouped_to_local_name(name)
    if name.startswith("decoder.layers."):
        parts = name.split(".")
        idx = int(parts[2])
        generic = ".".join(parts[:2] + ["{i}"] + parts[3:])
    else:
        idx, generic = None, name
    for rule in mapping:
        if rule.megatron == generic:
            return rule, idx
    raise KeyError(f"no HF mapping for Megatron parameter {name!r}")


def merge_tp_shards_to_hf(megatron_name_local: str, shards: list[Tensor], hf_config, global_layer_idx: int | None,
                          mapping=None) -> list[tuple[str, Tensor]]:
    """One Megatron parameter (its TP shards, in TP-rank order) -> full HF (name, tensor) pairs.

    Vocab padding is dropped. Returns [] for the output layer of a tied model (HF keeps one copy).
    """
    rule, _ = _local_to_rule(megatron_name_local, get_mapping(hf_config, mapping))
    names = [n.format(i=global_layer_idx) for n in rule.hf]
    kind = rule.kind
    if kind == "vocab":
        if rule.megatron == "output_layer.weight" and _tied(hf_config):
            return []
        return [(names[0], torch.cat(shards, dim=0)[: hf_config.vocab_size].contiguous())]
    if kind == "rep":
        return [(names[0], shards[0].clone())]
    if kind == "col":
        return [(names[0], torch.cat(shards, dim=0))]
    if kind == "row":
        return [(names[0], torch.cat(shards, dim=1))]
    if kind == "qkv":
        return list(zip(names, _qkv_split(torch.cat(shards, dim=0), hf_config)))
    if kind == "fc1":
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        gate = torch.cat([h[0] for h in halves], dim=0)
        up = torch.cat([h[1] for h in halves], dim=0)
        return [(names[0], gate), (names[1], up)]
    raise ValueError(f"unknown split kind {kind!r}")


# ----------------------------------------------------------------------------- whole-model conversion
def stage_layers(cfg, pp: int, pp_rank: int) -> range:
    L = cfg.num_hidden_layers
    if L % pp:
        raise CheckpointError(f"pp={pp} does not divide num_hidden_layers={L}")
    n = L // pp
    return range(pp_rank * n, (pp_rank + 1) * n)


def stage_rules(cfg, mapping, pp: int, pp_rank: int):
    """(rule, local_idx, global_idx) for every parameter on one pipeline stage, in a fixed order:
    layer by layer (all of layer i's parameters together), which is the order resync streams them
    in: its buckets keep only consecutive tensors of one layer together, and vLLM's in-place reload
    must see every tensor of a fused module (qkv_proj's weight and bias) in one load."""
    first, last = pp_rank == 0, pp_rank == pp - 1
    out = []
    layer_rules, layers_at = [], None
    for rule in mapping:
        if rule.optional and not _has_qkv_bias(cfg):
            continue
        if "{i}" in rule.megatron:
            if layers_at is None:
                layers_at = len(out)
            layer_rules.append(rule)
        elif rule.megatron.startswith("embedding.") and first:
            out.append((rule, None, None))
        elif rule.megatron == "output_layer.weight" and last and not (_tied(cfg) and pp == 1):
            out.append((rule, None, None))
        elif rule.megatron.startswith("decoder.final_layernorm") and last:
            out.append((rule, None, None))
    if layers_at is not None:
        out[layers_at:layers_at] = [(rule, local, g) for local, g in enumerate(stage_layers(cfg, pp, pp_rank))
                                    for rule in layer_rules]
    return out


def hf_to_megatron_shards(hf_state: dict[str, Tensor], hf_config, tp: int, pp: int, vocab_divisible_by: int = 128,
                          mapping=None, validate: bool = True,
                          only: tuple[int, int] | None = None, ep: int = 1,
                          ep_rank: int | None = None) -> dict[tuple[int, int], dict[str, Tensor]]:
    """Full HF state -> {(tp_rank, pp_rank): {stage-local Megatron name: shard}}.

    `only=(tp_rank, pp_rank)` builds just that rank's shards (what a loading rank needs).
    `ep_rank` (with `ep` > 1): only that expert-parallel rank's experts, numbered locally as its
    model names them; without it every expert, by its global index.
    """
    if validate:
        validate_hf_state(hf_state, hf_config)
    mapping = get_mapping(hf_config, mapping)
    shards: dict[tuple[int, int], dict[str, Tensor]] = {(t, p): {} for t in range(tp) for p in range(pp)}
    if only is not None:
        shards = {only: {}}
    for p in range(pp):
        if only is not None and p != only[1]:
            continue
        for rule, local, g in stage_rules(hf_config, mapping, pp, p):
            if ep_rank is not None and ep > 1 and expert_owner(rule.megatron, hf_config, ep) not in (None, ep_rank):
                continue
            hf_names = [n.format(i=g) for n in rule.hf]
            if rule.megatron == "output_layer.weight" and _tied(hf_config):
                hf_names = ["model.embed_tokens.weight"]
            try:
                tensors = [hf_state[n] for n in hf_names]
            except KeyError as e:
                raise CheckpointError(f"checkpoint is missing tensor {e.args[0]!r}") from None
            parts = split_for_tp(rule, tensors, hf_config, tp, vocab_divisible_by)
            name = rule.megatron.format(i=local)
            if ep_rank is not None:
                name = ep_local_name(name, hf_config, ep)
            for t in range(tp):
                if (t, p) in shards:
                    shards[(t, p)][name] = parts[t]
    return shards


def merge_ep_shards(per_ep_rank: list[dict[str, Tensor]], cfg) -> dict[str, Tensor]:
    """One (tp, pp) rank's shards from every EP rank (in EP-rank order) -> globally named shards."""
    ep = len(per_ep_rank)
    out: dict[str, Tensor] = {}
    for r, tensors in enumerate(per_ep_rank):
        for name, t in tensors.items():
            out.setdefault(ep_global_name(name, cfg, ep, r), t)
    return out


def megatron_shards_to_hf(shards: dict[tuple[int, int], dict[str, Tensor]], hf_config, tp: int, pp: int,
                          mapping=None) -> dict[str, Tensor]:
    """Inverse of hf_to_megatron_shards (vocab padding dropped, tied head omitted)."""
    mapping = get_mapping(hf_config, mapping)
    out: dict[str, Tensor] = {}
    for p in range(pp):
        layers = stage_layers(hf_config, pp, p)
        for name in shards[(0, p)]:
            if name.endswith("_extra_state"):
                continue
            _, local = _local_to_rule(name, mapping)
            g = layers[local] if local is not None else None
            parts = []
            for t in range(tp):
                if name not in shards[(t, p)]:
                    raise CheckpointError(f"Megatron shard (tp={t}, pp={p}) is missing tensor {name!r}")
                parts.append(shards[(t, p)][name])
            for hf_name, tensor in merge_tp_shards_to_hf(name, parts, hf_config, g, mapping):
                out[hf_name] = tensor
    return out
