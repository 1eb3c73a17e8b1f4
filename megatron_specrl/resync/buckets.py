"""Weight-resync buckets: tensors flattened per dtype into one contiguous buffer.

A bucket is the unit a transport moves (one NCCL broadcast / one IPC handle /
one object-store blob per dtype instead of one per tensor). `plan_buckets`
streams: it only holds references to the source tensors until a bucket is
full, then materialises that bucket, so the extra memory is about one bucket.
Tensors of one transformer layer stay in one bucket: vLLM's in-place reload
repacks fused linears (qkv, gate_up) per layer and must see the whole layer.
With `dtype` (the engine's, e.g. bf16) each floating tensor is cast as it enters
the plan, so the bucket budget and the bytes every transport moves are the cast
ones; the engine would round to its dtype on load anyway, so the result is the same.
"""

from __future__ import annotations

import json
import warnings
import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch

_LAYER = re.compile(r"^(.*?layers\.\d+)\.")


def layer_group(name: str) -> str:
    """Group key: 'model.layers.3' for every tensor of layer 3, the name itself otherwise."""
    m = _LAYER.match(name)
    return m.group(1) if m else name


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str          # e.g. "float32" (torch.<dtype>)
    shape: tuple[int, ...]
    offset: int         # in elements, inside the buffer of its dtype
    numel: int


@dataclass
class Bucket:
    buffers: dict[str, torch.Tensor]            # dtype name -> 1-D contiguous buffer
    metas: list[TensorMeta] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.metas]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    @classmethod
    def from_tensors(cls, named: list[tuple[str, torch.Tensor]]) -> "Bucket":
        by_dtype: dict[str, list[torch.Tensor]] = {}
        metas = []
        for name, t in named:
            key = str(t.dtype).removeprefix("torch.")
            parts = by_dtype.setdefault(key, [])
            offset = sum(p.numel() for p in parts)
            metas.append(TensorMeta(name, key, tuple(t.shape), offset, t.numel()))
            parts.append(t.detach().reshape(-1))
        # A lone tensor is used as it is (a view, no copy): the bucket only reads its buffers.
        buffers = {k: torch.cat(v) if len(v) > 1 else v[0] for k, v in by_dtype.items()}
        return cls(buffers, metas)

    def unflatten(self) -> list[tuple[str, torch.Tensor]]:
        """Views into the buffers (no copy), in the original order."""
        return [(m.name, self.buffers[m.dtype][m.offset:m.offset + m.numel].view(m.shape)) for m in self.metas]

    def meta_json(self) -> str:
        return json.dumps([[m.name, m.dtype, list(m.shape), m.offset, m.numel] for m in self.metas])

    @staticmethod
    def metas_from_json(text: str) -> list[TensorMeta]:
        return [TensorMeta(n, d, tuple(s), o, k) for n, d, s, o, k in json.loads(text)]

    def to_payload(self) -> dict:
        """Numpy views of the buffers + metadata: Ray serialises numpy zero-copy into its object
        store (one copy, no safetensors blob), and readers map it without copying. bf16 has no
        numpy dtype, so it travels as int16 bits."""
        arrays = {k: (v.view(torch.int16) if v.dtype == torch.bfloat16 else v).cpu().numpy()
                  for k, v in self.buffers.items()}
        return {"meta": self.meta_json(), "arrays": arrays}

    @classmethod
    def from_payload(cls, payload: dict) -> "Bucket":
        buffers = {}
        for k, arr in payload["arrays"].items():
            with warnings.catch_warnings():   # read-only object-store memory: we only read it
                warnings.simplefilter("ignore", UserWarning)
                t = torch.from_numpy(arr)
            buffers[k] = t.view(torch.bfloat16) if k == "bfloat16" else t
        return cls(buffers, cls.metas_from_json(payload["meta"]))

    @classmethod
    def from_wire(cls, obj: "dict | bytes") -> "Bucket":
        """Either form a bucket crosses processes in: a numpy payload or a safetensors blob."""
        return cls.from_payload(obj) if isinstance(obj, dict) else cls.from_bytes(obj)

    def to_bytes(self) -> bytes:
        """safetensors blob (buffers + metadata) for crossing process boundaries."""
        from safetensors.torch import save
        return save({k: v.contiguous().cpu() for k, v in self.buffers.items()},
                    metadata={"specrl_bucket": self.meta_json()})

    @classmethod
    def from_bytes(cls, blob: bytes) -> "Bucket":
        from safetensors.torch import load
        buffers = load(blob)
        # safetensors.torch.load drops metadata; read the header directly.
        header_len = int.from_bytes(blob[:8], "little")
        header = json.loads(blob[8:8 + header_len])
        return cls(buffers, cls.metas_from_json(header["__metadata__"]["specrl_bucket"]))


def wire_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """torch dtype for an engine dtype name ("bfloat16", "float32"); None stays None (no cast)."""
    if name is None or isinstance(name, torch.dtype):
        return name
    dt = getattr(torch, str(name), None)
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise ValueError(f"resync dtype must be a floating torch dtype name, got {name!r}")
    return dt


def cast_floating(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`t` in `dtype` if it is floating (integer buffers keep theirs); the same tensor if no cast."""
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def plan_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                 group_key: Callable[[str], str] = layer_group,
                 dtype: str | torch.dtype | None = None) -> Iterator[Bucket]:
    """Yield buckets of at most `bucket_bytes` (a group larger than that gets its own bucket).
    Consecutive tensors with the same `group_key` are never split across buckets. `dtype`: cast
    floating tensors to it first (one tensor at a time; the fp32 source is dropped after)."""
    if bucket_bytes <= 0:
        raise ValueError("bucket_bytes must be positive")
    dtype = wire_dtype(dtype)
    pending: list[tuple[str, torch.Tensor]] = []     # whole groups waiting for the bucket
    pending_bytes = 0
    group: list[tuple[str, torch.Tensor]] = []
    group_bytes, current = 0, None

    def close_group():
        nonlocal pending, pending_bytes
        out = None
        if pending and pending_bytes + group_bytes > bucket_bytes:
            out = Bucket.from_tensors(pending)
            pending, pending_bytes = [], 0
        pending.extend(group)
        pending_bytes += group_bytes
        return out

    for name, t in named_tensors:
        key = group_key(name)
        if group and key != current:
            if (b := close_group()) is not None:
                yield b
            group, group_bytes = [], 0
        current = key
        t = cast_floating(t, dtype)
        group.append((name, t))
        group_bytes += t.numel() * t.element_size()
    if group and (b := close_group()) is not None:
        yield b
    if pending:
        yield Bucket.from_tensors(pending)
