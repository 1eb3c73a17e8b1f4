"""Colocated vs disaggregated placement: GPU shares per actor, and impossible layouts named."""

import pytest

from megatron_specrl.config import ConfigError, load_config
from megatron_specrl.placement import plan_placement


def _cfg(*over):
    return load_config(None, list(over))


def test_cpu_asks_for_no_gpus_in_either_mode():
    for colocate in ("true", "false"):
        p = plan_placement(_cfg(f"rollout.colocate={colocate}"), gpus_available=0)
        assert p.learner_gpus_per_rank == 0 and p.gpus_per_engine == 0 and not p.engines_sleep_during_training


def test_colocated_shares_each_gpu_and_sleeps_engines():
    p = plan_placement(_cfg("learner.tp=2", "learner.pp=2", "rollout.num_engines=4"), gpus_available=8)
    assert (p.learner_gpus_per_rank, p.gpus_per_engine) == (0.5, 0.5) and p.engines_sleep_during_training


def test_disaggregated_uses_separate_pools():
    p = plan_placement(_cfg("rollout.colocate=false", "learner.tp=2", "rollout.num_engines=2",
                            "rollout.engine_tp=2"), gpus_available=8)
    assert (p.learner_gpus_per_rank, p.gpus_per_engine) == (1.0, 2.0) and not p.engines_sleep_during_training


@pytest.mark.parametrize("over, gpus, needle", [
    (["rollout.colocate=false", "learner.tp=4", "rollout.num_engines=2", "rollout.engine_tp=4"], 8,
     "= 12 GPUs, the cluster has 8"),
    (["rollout.num_engines=4"], 8, "num_engines (4) <= learner world size (1)"),
    (["rollout.engine_tp=2", "learner.tp=2"], 8, "rollout.engine_tp=2"),
])
def test_impossible_layouts_are_named(over, gpus, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        plan_placement(_cfg(*over), gpus_available=gpus)
