"""Where the package finds its recipes and version pins (megatron_specrl/shipped.py): the installed copy,
else the checkout's; a recipe's `${shipped:...}` path as written where it exists from the working
directory. The wheel itself is built and run in tests/integration/test_packaging.py."""

from __future__ import annotations

from megatron_specrl import shipped
from megatron_specrl.config import EXAMPLES, load_config, resolve_recipe
from tests.helpers.paths import REPO_ROOT


def test_a_checkout_reads_its_own_files():
    assert shipped.CHECKOUT == REPO_ROOT
    assert shipped.shipped_path("examples") == EXAMPLES == REPO_ROOT / "examples"
    assert resolve_recipe("tiny-cpu-grpo") == REPO_ROOT / "examples" / "tiny-cpu-grpo.yaml"


def test_the_installed_copy_wins_and_a_wheel_install_has_no_checkout(tmp_path, monkeypatch):
    installed = tmp_path / "_data"
    (installed / "docker").mkdir(parents=True)
    (installed / "docker" / "constraints-gpu.txt").write_text("vllm==0\n")
    monkeypatch.setattr(shipped, "_INSTALLED", installed)
    assert shipped.shipped_path("docker/constraints-gpu.txt") == installed / "docker" / "constraints-gpu.txt"
    assert shipped.shipped_path("examples/x.yaml") == REPO_ROOT / "examples" / "x.yaml"   # not installed: the checkout's
    monkeypatch.setattr(shipped, "CHECKOUT", None)
    assert shipped.shipped_path("examples/x.yaml") == installed / "examples" / "x.yaml"   # named in the error


def test_a_recipe_names_shipped_files_as_written_from_the_checkout_root_else_by_their_installed_path(
        tmp_path, monkeypatch):
    monkeypatch.delenv("SPECRL_MODEL", raising=False)
    monkeypatch.delenv("SPECRL_DATA", raising=False)
    recipe = REPO_ROOT / "examples" / "qwen3-8b-dapo-1node.yaml"
    monkeypatch.chdir(REPO_ROOT)
    cfg = load_config(recipe)
    assert (cfg.model.path, cfg.data.source) == ("examples/models/qwen3-8b", "examples/data/math-format-sample.jsonl")
    monkeypatch.chdir(tmp_path)     # elsewhere the relative path would name nothing
    cfg = load_config(recipe)
    assert cfg.model.path == str(REPO_ROOT / "examples" / "models" / "qwen3-8b")
    assert cfg.data.source == str(REPO_ROOT / "examples" / "data" / "math-format-sample.jsonl")
    monkeypatch.setenv("SPECRL_MODEL", "/models/qwen3-8b")          # the environment still wins
    assert load_config(recipe).model.path == "/models/qwen3-8b"
