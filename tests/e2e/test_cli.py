"""Recipes + overrides: good ones resolve, bad ones fail with one line naming the key and value.

The tests of this subject that start processes or engines; the rest are in tests/unit/test_config.py.
"""

from __future__ import annotations
import subprocess
import sys
import pytest


from tests.helpers.paths import REPO_ROOT as ROOT

@pytest.mark.parametrize("args, needle", [
    (["learner.tp=3"], "learner.tp=3 does not divide num_attention_heads=4"),
    (["learner.pp=4"], "learner.pp=4 does not divide num_hidden_layers=2"),
    (["learner.bogus=1"], "unknown config key 'learner.bogus'"),
    (["reward.name=nope"], "invalid value for 'reward.name': 'nope' (Value error, unknown reward 'nope'"),
    (["reward.name=no_such_pkg.score"], "'reward.name': 'no_such_pkg.score'"),
    (["learner.loss.kl_type=low-var"], "use learner.loss.kl_type=low_var_kl"),
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


