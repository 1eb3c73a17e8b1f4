"""Bounded-staleness rollouts (trainer.max_staleness, run/overlap.py) without engines: which steps run a
rollout ahead, the version lag of what is trained, the rollout in flight and its recovery, and the cores
an overlapped CPU run gives its engines."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from megatron_specrl.config import load_config
from tests.helpers.paths import REPO_ROOT
from megatron_specrl.engines.protocol import EngineError
from megatron_specrl.run.overlap import (Collected, RolloutAhead, overlap_s, split_cores, staleness, starts_ahead,
                                         step_times)


def _cfg(*overrides):
    return load_config(str(REPO_ROOT / "examples" / "tiny-cpu-grpo.yaml"), ["trainer.total_steps=40", "trainer.eval_every=16",
                                         "trainer.checkpoint_every=32", *overrides])


def test_steps_before_a_checkpoint_eval_or_the_end_start_no_rollout_ahead():
    cfg = _cfg("trainer.max_staleness=1", "trainer.check_resync_every=10")
    ahead = [s for s in range(1, 41) if starts_ahead(cfg, s)]
    assert 16 not in ahead and 32 not in ahead and 10 not in ahead and 40 not in ahead   # eval, ckpt, check, last
    assert set(range(1, 41)) - set(ahead) == {10, 16, 20, 30, 32, 40}
    assert not any(starts_ahead(_cfg(), s) for s in range(1, 41))                       # synchronous: never


class _Loader:
    def __init__(self):
        self.position = 0

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


class _Store:
    def __init__(self):
        self.begun = self.undone = 0

    def begin_step(self):
        self.begun += 1

    def undo_step(self):
        self.undone += 1


def _run(version=0):
    return SimpleNamespace(loader=_Loader(), store=_Store(), version=version)


def test_no_trained_batch_is_more_than_one_version_behind():
    """The loop of trainer.train_step reduced to its versions: a rollout starts under the engines' weights
    (run.version) beside the train step, the engines are resynced only after it finished. Every batch
    is trained from the version after the one that generated it, or the same one after a sync step."""
    cfg = _cfg("trainer.max_staleness=1")
    run, ahead, lags = _run(), RolloutAhead(), []
    for step in range(1, 41):
        got = ahead.take(run, step, None) if ahead.holds(step) else Collected([], torch.zeros(0), {}, run.version)
        if starts_ahead(cfg, step):
            ahead.start(run, step + 1, lambda: ([], torch.zeros(0), {}))
        ahead.wait()
        lags.append(staleness(run.version, got.version)["async/staleness_max"])
        run.version += 1                     # the learner's step, then the resync
    ahead.shutdown()
    assert max(lags) == 1.0 and min(lags) == 0.0
    assert lags[16] == lags[32] == 0.0       # steps 17 and 33 follow an eval / checkpoint: generated after the resync
    assert sum(lags) == 40 - 3               # all others one behind: not step 1, nor 17 and 33 (after 16, 32)


def test_the_rollout_in_flight_runs_beside_the_caller():
    run, ahead, inside = _run(), RolloutAhead(), threading.Event()

    def collect():
        inside.set()
        time.sleep(0.2)
        return ["s"], torch.ones(1), {"spec/x": 1.0}

    ahead.start(run, 5, collect)
    assert inside.wait(5) and ahead.holds(5) and not ahead.holds(6)   # started while the caller goes on
    got = ahead.wait()
    assert got.samples == ["s"] and got.version == 0 and got.rollout_s >= 0.19
    assert ahead.take(run, 5, None) is got and not ahead.holds(5)
    assert run.store.begun == 1
    ahead.shutdown()


def test_a_rollout_that_loses_an_engine_is_collected_again_from_where_it_started():
    run, ahead = _run(version=3), RolloutAhead()
    run.loader.position = 7

    def dies():
        run.loader.position = 9                 # it had taken its prompts
        raise EngineError("engine core died", "vllm-0")

    ahead.start(run, 4, dies)
    assert ahead.wait() is None                  # the error is left for take
    seen = []
    got = ahead.take(run, 4, lambda state: seen.append(state) or Collected(["again"], torch.zeros(1), {}, run.version))
    assert seen == [{"position": 7}] and got.samples == ["again"] and got.version == 3
    ahead.shutdown()


def test_other_errors_of_the_rollout_reach_the_step():
    run, ahead = _run(), RolloutAhead()

    def bad():
        raise ValueError("reward is NaN")

    ahead.start(run, 2, bad)
    with pytest.raises(ValueError, match="reward is NaN"):
        ahead.take(run, 2, lambda state: pytest.fail("not an engine failure"))
    ahead.shutdown()


def test_step_times_count_what_ran_beside_what():
    own = Collected([], torch.zeros(0), {}, 0, started=0.0, finished=1.0)        # this step's, run in it
    nxt = Collected([], torch.zeros(0), {}, 0, started=1.5, finished=2.5)        # the next step's, beside training
    t = step_times(0.0, 3.0, own, nxt, train_s=1.2)
    assert t["time/rollout_s"] == 1.0 and t["time/overlap_s"] == 1.0
    assert t["time/learner_idle_s"] == pytest.approx(1.8) and t["time/engine_idle_s"] == pytest.approx(1.0)
    ran_before = Collected([], torch.zeros(0), {}, 0, started=-2.0, finished=-0.5)   # ran in the previous step
    assert step_times(0.0, 3.0, ran_before, None, 1.2)["time/engine_idle_s"] == 3.0
    assert overlap_s((0, 1), (2, 3)) == 0.0 and overlap_s((0, 2), (1, 3)) == 1.0


def test_an_overlapped_cpu_run_gives_the_engines_the_upper_half_of_the_cores():
    env = {}
    assert split_cores(_cfg("trainer.max_staleness=1"), env, cpus=[0, 1]) == "1" == env["VLLM_CPU_OMP_THREADS_BIND"]
    assert split_cores(_cfg("trainer.max_staleness=1", "rollout.engine_tp=2"), {}, cpus=range(8)) == "4,5|6,7"
    assert split_cores(_cfg(), {}, cpus=[0, 1]) is None                                   # synchronous
    assert split_cores(_cfg("trainer.max_staleness=1"), {"VLLM_CPU_OMP_THREADS_BIND": "0"}, cpus=[0, 1]) is None
    assert split_cores(_cfg("trainer.max_staleness=1"), {}, cpus=[0]) is None             # one core: nothing to split


def test_staleness_needs_the_decoupled_correction():
    cfg = _cfg("trainer.max_staleness=1")
    assert cfg.learner.recompute_old_logprobs is True and cfg.learner.loss.tis == "token"
    with pytest.raises(Exception, match="learner.loss.tis=off"):
        _cfg("trainer.max_staleness=1", "learner.loss.tis=off")
    with pytest.raises(Exception, match="recompute_old_logprobs=false"):
        _cfg("trainer.max_staleness=1", "learner.recompute_old_logprobs=false")


def test_the_split_reaches_the_in_process_engine_and_the_learner_ranks_as_pinned_threads():
    """vLLM applies its binding only to workers it spawns; ours run in-process, so the engine actor's env
    pins its OpenMP threads itself, and the learner ranks get the other cores."""
    from megatron_specrl.engines.ray_engine import cpu_thread_env
    from megatron_specrl.learner.group import rank_env

    env = {}
    split_cores(_cfg("trainer.max_staleness=1"), env, cpus=[0, 1, 2, 3])
    assert cpu_thread_env(env["VLLM_CPU_OMP_THREADS_BIND"]) == {"OMP_NUM_THREADS": "2", "GOMP_CPU_AFFINITY": "2 3"}
    ranks = rank_env(0.0, environ=env)
    assert ranks["OMP_NUM_THREADS"] == "1" and ranks["GOMP_CPU_AFFINITY"] == "0 1"
    assert "GOMP_CPU_AFFINITY" not in rank_env(0.0, environ={})                      # synchronous: unpinned
    assert set(cpu_thread_env(None)) == {"OMP_NUM_THREADS"} == set(cpu_thread_env("0,1|2,3"))   # TP workers: vLLM's
