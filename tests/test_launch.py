"""The Slurm launcher renders a Ray cluster + train command and validates the recipe first."""

import pytest

from megatron_specrl.config import ConfigError
from megatron_specrl.launch import launch_main


def test_renders_head_workers_and_driver(tmp_path):
    out = tmp_path / "job.sbatch"
    assert launch_main(["tiny-cpu-dapo", "learner.tp=2", "--nodes", "4", "--partition", "gpu",
                        "--out", str(out)]) == 0
    text = out.read_text()
    assert "#SBATCH --nodes=4" in text and "#SBATCH --partition=gpu" in text
    assert "ray start --head" in text and 'ray start --address="$RAY_ADDRESS"' in text
    assert "megatron-specrl train" in text and "tiny-cpu-dapo.yaml ray.address=auto learner.tp=2" in text


def test_bad_override_fails_before_rendering(tmp_path):
    with pytest.raises(ConfigError, match="learner.nope"):
        launch_main(["tiny-cpu-dapo", "learner.nope=1", "--out", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()
