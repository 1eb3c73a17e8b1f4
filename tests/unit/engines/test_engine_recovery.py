"""with_engine_recovery: a rollout whose engine dies is collected once more from the same prompts, with
the loader and the trajectory store as they were before the first attempt.
"""

from __future__ import annotations
from types import SimpleNamespace
from megatron_specrl.data.datasets import PromptLoader, PromptRecord
from megatron_specrl.engines.protocol import EngineError
from megatron_specrl.rollout.store import Trajectory, TrajectoryStore
from megatron_specrl.run.recovery import with_engine_recovery

def _traj(tokens, version):
    return Trajectory(list(tokens), [-0.5] * len(tokens), "stop", version)


def test_a_retried_rollout_sees_the_loader_and_the_store_as_before(tmp_path):
    records = [PromptRecord(id=f"p{i}", prompt=f"{i}+1=", answer=str(i + 1)) for i in range(8)]
    store = TrajectoryStore()
    store.put("p0", 0, _traj([1, 2, 3], 4))              # last epoch's sample: a draft for this step
    restarts = []
    run = SimpleNamespace(cfg=SimpleNamespace(rollout=SimpleNamespace(draft="tree")),
                          loader=PromptLoader(records, batch_size=2, seed=0), store=store, version=0,
                          out=tmp_path, engine=SimpleNamespace(restart=lambda: restarts.append(1)))
    attempts = []

    def collect():   # two DAPO rounds; the engine dies in the second round of the first attempt
        seen = []
        for rnd in range(2):
            batch = [r.id for r in run.loader.next_batch()]
            seen.append((batch, store.get("p0", 0).token_ids if store.get("p0", 0) else None,
                         {p: store.get(p, 0) is not None for p in batch}))
            for p in batch:
                store.put(p, 0, _traj([7, 7], 5))
            if rnd == 1 and not attempts:
                attempts.append(seen)
                raise EngineError("engine vllm-0 died")
        attempts.append(seen)
        return [], None, {}

    _, _, metrics = with_engine_recovery(run, 5, collect)
    first, retry = attempts
    assert metrics["engine/restarts"] == 1.0 and restarts == [1]
    assert retry == first          # the same prompts, each finding the stored samples it found the first time
    assert all(store.get(p, 0).token_ids == [7, 7] for batch, _, _ in retry for p in batch)


def test_a_failed_resync_restarts_the_engines_and_pushes_the_weights_again(tmp_path):
    """The learner still holds the step's weights: a resync that fails half way (an engine dies, the
    group times out) is repaired by fresh engines and one more full push; a second failure ends the run."""
    import pytest

    from megatron_specrl.resync.group import ResyncTransportError
    from megatron_specrl.run.recovery import resync_with_recovery

    events = []
    failures = [ResyncTransportError("resync broadcast: timed out waiting for vllm-0")]

    def resync(wake_engines=False):
        events.append(("resync", wake_engines))
        if failures:
            raise failures.pop(0)
        return {"resync/version": 7.0}

    run = SimpleNamespace(cfg=SimpleNamespace(rollout=SimpleNamespace(draft="none")), version=7, out=tmp_path,
                          engine=SimpleNamespace(restart=lambda: events.append(("restart",))), resync=resync)
    metrics = resync_with_recovery(run, step=3, wake_engines=True)
    assert events == [("resync", True), ("restart",), ("resync", False)]   # restarted engines are awake
    assert metrics == {"resync/version": 7.0, "engine/resync_restarts": 1.0}

    failures[:] = [EngineError("engine vllm-0 died"), EngineError("engine vllm-0 died again")]
    with pytest.raises(EngineError, match="again"):
        resync_with_recovery(run, step=4)
