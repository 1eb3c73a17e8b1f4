"""Recipes + overrides: good ones resolve, bad ones fail with one line naming the key and value."""

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_specrl.cli import main
from megatron_specrl.config import ConfigError, load_config, to_yaml

ROOT = Path(__file__).resolve().parent.parent
RECIPES = sorted((ROOT / "examples").glob("tiny-cpu-*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_validates(recipe):
    cfg = load_config(recipe)
    assert cfg.rollout.spec_mode in ("exact", "lenient")
    assert cfg.output_dir.startswith("outputs/")


def test_overrides_are_dotted_and_typed():
    cfg = load_config(ROOT / "examples/tiny-cpu-grpo.yaml",
                      ["learner.tp=2", "rollout.spec_mode=exact", "learner.loss.clip_high=0.28", "output_dir=/tmp/x"])
    assert cfg.learner.tp == 2 and cfg.rollout.spec_mode == "exact"
    assert cfg.learner.loss.clip_high == 0.28 and cfg.output_dir == "/tmp/x"


@pytest.mark.parametrize("override, needle", [
    ("learner.tpp=2", "unknown config key 'learner.tpp'"),
    ("rollout.lenience=0.5", "'rollout.lenience': 0.5"),
    ("rollout.max_new_tokens=-8", "'rollout.max_new_tokens': -8"),
    ("learner.lr=fast", "'learner.lr': 'fast'"),
    ("rollout.spec_mode=greedy", "'rollout.spec_mode': 'greedy'"),
    ("algorithm.name=reinforce", "'algorithm.name'"),
    ("rollout.max_model_len=32", "rollout.max_model_len=32"),
    ("learner.dp=3", "learner.dp * learner.mini_batches = 3"),
    ("nokey", "not of the form key=value"),
    ("data.synthetic_terms=[6,3]", "'data.synthetic_terms'"),
])
def test_bad_values_name_the_key(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "examples/tiny-cpu-grpo.yaml", [override])
    assert needle in str(err.value)


def test_spec_mode_off_survives_yaml(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("rollout:\n  spec_mode: off\n")
    assert load_config(recipe).rollout.spec_mode == "off"
    assert load_config(None, ["rollout.spec_mode=off"]).rollout.spec_mode == "off"


def test_malformed_recipe_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="recipe file not found"):
        load_config(tmp_path / "missing.yaml")


def test_cli_dry_run_prints_resolved_config(capsys):
    assert main(["train", "tiny-cpu-grpo", "rollout.n_samples=4", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "n_samples: 4" in out and "spec_mode: lenient" in out


@pytest.mark.parametrize("args, needle", [
    (["learner.tp=3"], "learner.tp=3 does not divide num_attention_heads=4"),
    (["learner.pp=4"], "learner.pp=4 does not divide num_hidden_layers=2"),
    (["learner.bogus=1"], "unknown config key 'learner.bogus'"),
])
def test_cli_bad_input_is_one_line_and_nonzero(args, needle):
    proc = subprocess.run([sys.executable, "-m", "megatron_specrl.cli", "train", "tiny-cpu-grpo", *args, "--dry-run"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], proc.stderr


def test_train_help_lists_dry_run():
    proc = subprocess.run([sys.executable, "-m", "megatron_specrl.cli", "train", "--help"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0 and "--dry-run" in proc.stdout


def test_engine_dtype_and_recompute_old_logprobs():
    recipe = ROOT / "examples/tiny-cpu-grpo.yaml"
    fp32 = load_config(recipe)
    assert fp32.rollout.engine_dtype == "float32" and fp32.learner.recompute_old_logprobs is False
    assert load_config(recipe, ["learner.recompute_old_logprobs=true"]).learner.recompute_old_logprobs is True
    bf16 = load_config(recipe, ["rollout.engine_dtype=bfloat16"])
    assert bf16.rollout.engine_dtype == "bfloat16"
    assert bf16.learner.recompute_old_logprobs is True              # learner log-probs in the PPO ratio
    assert "recompute_old_logprobs: true" in to_yaml(bf16)          # resolved, so a resume reads the same
    with pytest.raises(ConfigError) as err:
        load_config(recipe, ["rollout.engine_dtype=bfloat16", "learner.recompute_old_logprobs=false"])
    assert "learner.recompute_old_logprobs=false with rollout.engine_dtype=bfloat16" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(recipe, ["rollout.engine_dtype=float16"])
    assert "'rollout.engine_dtype': 'float16'" in str(err.value) and "\n" not in str(err.value)
