"""Import-time stand-ins SGLang 0.5.23 needs to start on a CPU without its CUDA-only packages.

SGLang's CPU path (`SGLANG_USE_CPU_ENGINE=1`, `device="cpu"`, the torch-native attention backend) runs on
these machines, but two names it imports have no CPU install:

- `sgl_kernel` (PyPI `sglang-kernel` / `sgl-kernel`: sm90 / sm100 CUDA libraries only, no source
  distribution). SGLang's modules import its ops at module level behind `if _is_cpu:` (`from sgl_kernel
  import copy_all_layer_kv_cache_cpu`, not all inside `try`). The stand-in is the top-level name only, a
  module that is not a package: `from sgl_kernel import op` gives a placeholder that raises, naming the op,
  when called, and `import sgl_kernel.sub` still raises ImportError, so SGLang's own `except ImportError`
  fallbacks around its submodules run. Without the AMX kernels (`_is_cpu_amx_available` false) RMSNorm,
  SiLU-and-mul, RoPE and the linear layers take their `forward_native` paths; plain generation, prompt
  log-probs and weight updates call no `sgl_kernel` op (the integration tests run them).
- `torchvision`, imported at module level by SGLang's multimodal processors (`from torchvision.transforms
  import InterpolationMode`), which the server imports at start to register them. PyPI's torchvision is a
  CUDA build that breaks `transformers` beside the CPU torch (tools/setup_env.sh uninstalls it). The
  stand-in answers every `torchvision.*` import and attribute with a placeholder that refuses to be called:
  text models never call it; an image or video request fails naming this module.

When: before SGLang is imported, in every SGLang process. `sglang.Engine` spawns its scheduler and
detokenizer processes (multiprocessing "spawn"), and they import SGLang's layers, and so these names,
while unpickling their entry function, before SGLang's `sglang.srt.plugins` entry points run
(`load_plugins()` in the scheduler): a plugin is too late. A `.pth` file in the environment's
site-packages runs at interpreter start, early enough. tools/setup_env.sh (the CPU install, never the GPU
container) writes it (`PTH_NAME`, `PTH_LINE`); the line imports this module and calls `install()` only
where `SGLANG_USE_CPU_ENGINE=1` (SGLang's own switch for its CPU path, which our engine sets on CPU and its
spawned processes inherit): every other process of the environment, vLLM's included, is left as it is.
Our engine also calls `install()` in its own process before it imports SGLang.

Pinned: `install()` acts only on sglang 0.5.23 (`SGLANG_VERSION`), where a real `sgl_kernel` /
`torchvision` is not importable, and only once; `uninstall()` reverts it (our engine, once SGLang's
processes run, and tests).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types

SGLANG_VERSION = "0.5.23"
ENV = "SGLANG_USE_CPU_ENGINE"
PTH_NAME = "megatron_specrl_sglang_cpu.pth"
# one line: site runs .pth lines that start with "import"; nothing is imported unless ENV is "1"
PTH_LINE = (f"import os; os.environ.get({ENV!r}) == '1' and "
            f"__import__('megatron_specrl.patches.sglang_0_5_23_cpu_imports', fromlist=['_']).install()")

KERNEL, VISION = "sgl_kernel", "torchvision"


def installed_sglang_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


class _Placeholder:
    """Any attribute of a stand-in: attributes of it are placeholders too (class bodies read
    `InterpolationMode.BICUBIC` at import); calling one raises."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> "_Placeholder":
        if attr.startswith("__") or attr == "_name":
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: {self._name.partition('.')[0]} is a stand-in in this CPU install "
                           "(megatron_specrl.patches.sglang_0_5_23_cpu_imports): SGLang called a CUDA kernel or "
                           "an image / video transform, which this install does not have")

    def __mro_entries__(self, bases):   # `class X(torchvision.Something)` at import
        return (object,)

    def __repr__(self) -> str:
        return f"<stand-in {self._name}>"


class _StandInModule(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers `sgl_kernel` (not a package: no submodules) and `torchvision` with any submodule."""

    def find_spec(self, fullname, path=None, target=None):
        top = fullname.partition(".")[0]
        if fullname == KERNEL:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=False)
        if top == VISION:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StandInModule(spec.name, "stand-in: megatron_specrl.patches.sglang_0_5_23_cpu_imports")

    def exec_module(self, module):
        if module.__name__ == VISION:   # transformers compares it (is_torchvision_greater_or_equal)
            module.__version__ = "0.0.0+specrl.stand.in"


def _real(name: str) -> bool:
    """A real install of `name` is importable (our finder not consulted)."""
    mod = sys.modules.get(name)
    if mod is not None:
        return not isinstance(mod, _StandInModule)
    return any(f.find_spec(name, None) is not None for f in sys.meta_path
               if not isinstance(f, _Finder) and hasattr(f, "find_spec"))


def install() -> bool:
    """Put the stand-ins in front of the import system (idempotent). False where it does not apply:
    another SGLang release, or both names really installed."""
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return True
    if installed_sglang_version() != SGLANG_VERSION or (_real(KERNEL) and _real(VISION)):
        return False
    finder = _Finder()
    if _real(KERNEL) or _real(VISION):   # stand in only for the missing one
        missing = VISION if _real(KERNEL) else KERNEL
        finder.find_spec = (lambda name, path=None, target=None, _f=_Finder.find_spec:   # type: ignore
                            _f(finder, name, path, target) if name.partition(".")[0] == missing else None)
    sys.meta_path.insert(0, finder)
    return True


def uninstall() -> None:
    """Remove the finder and the stand-in modules it made, and forget what transformers cached about its
    optional packages meanwhile: it finds torchvision through the finder (`is_torchvision_available()`, an
    lru_cache), and would import the real, absent one later."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]
    for name in [n for n, m in sys.modules.items() if isinstance(m, _StandInModule)]:
        del sys.modules[name]
    import_utils = sys.modules.get("transformers.utils.import_utils")
    for f in vars(import_utils).values() if import_utils is not None else ():
        if callable(getattr(f, "cache_clear", None)):
            f.cache_clear()


def active() -> bool:
    return any(isinstance(f, _Finder) for f in sys.meta_path)


def write_pth(site_packages: str) -> str:
    """Write the .pth file into an environment's site-packages (tools/setup_env.sh, CPU installs only)."""
    path = os.path.join(site_packages, PTH_NAME)
    with open(path, "w") as f:
        f.write(PTH_LINE + "\n")
    return path


if __name__ == "__main__":   # python -m megatron_specrl.patches.sglang_0_5_23_cpu_imports SITE_PACKAGES
    print(write_pth(sys.argv[1]))
