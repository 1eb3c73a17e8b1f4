"""patches/ is installed as `megatron_specrl.patches`: no code imports a top-level `patches` (from the
repository root it would still import, as a second copy of every module whose patches and state
are not the ones the engines apply), and the engine plugin entry points name the namespaced modules."""

from __future__ import annotations

import ast
import importlib.metadata
from pathlib import Path

import megatron_specrl.patches

ROOT = Path(__file__).resolve().parents[2]


def _top_level_patches_imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [f"{path.relative_to(ROOT)}:{node.lineno}" for a in node.names
                    if a.name == "patches" or a.name.startswith("patches.")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and (node.module == "patches" or node.module.startswith("patches.")):
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return out


def test_nothing_imports_a_top_level_patches_package():
    found = [hit for folder in ("megatron_specrl", "patches", "benchmarks", "tests", "tools")
             for path in sorted((ROOT / folder).rglob("*.py")) for hit in _top_level_patches_imports(path)]
    assert not found, f"import megatron_specrl.patches... instead of patches...: {found}"


def test_the_namespaced_package_is_the_repository_folder():
    assert Path(megatron_specrl.patches.__file__).resolve() == ROOT / "patches" / "__init__.py"
    setup = (ROOT / "setup.py").read_text()
    assert '"megatron_specrl.patches": "patches"' in setup


def test_engine_plugin_entry_points_name_the_namespaced_modules():
    """What the installed metadata says (reinstall after a setup.py change: pip install -e .)."""
    for group, module in (("vllm.general_plugins", "megatron_specrl.patches.vllm_engine_patches"),
                          ("sglang.srt.plugins", "megatron_specrl.patches.sglang_engine_patches")):
        ours = [e for e in importlib.metadata.entry_points(group=group) if e.name == "specrl_patches"]
        assert [e.value for e in ours] == [f"{module}:plugin"], (group, ours)
        assert callable(ours[0].load())
