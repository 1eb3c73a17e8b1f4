"""The CLI commands that replaced the tools/ scripts: `doctor` (tools/gpu_check.py and the
gpu_stack check) and `bench-resync` (megatron_specrl/benchmarks/resync.py) parse their own flags under their
command's name; the removed wrappers' commands (bench-rollout, check-resync, convert) are listed."""

from __future__ import annotations

import pytest

from megatron_specrl.cli import PASSTHROUGH, build_parser, main


@pytest.mark.parametrize("command,flag", [("doctor", "--only"), ("bench-resync", "--bucket-mb")])
def test_command_help_is_its_own(command, flag, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: megatron-specrl {command}") and flag in text


def test_every_command_is_listed_and_passes_its_flags_through():
    choices = build_parser()._subparsers._group_actions[0].choices
    for name in ("train", "convert", "check-resync", "bench-rollout", "bench-resync", "doctor", "launch"):
        assert name in choices and name in PASSTHROUGH


def test_bench_resync_refuses_a_bad_flag_before_building_anything(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench-resync", "--transport", "carrier-pigeon"])
    assert e.value.code == 2 and "invalid choice: 'carrier-pigeon'" in capsys.readouterr().err
