"""Overlapped rollouts (trainer.overlap, trainer.max_staleness, run/overlap.py) without engines: which steps
run a rollout ahead, the version lag of what is trained, the exact overlap's refresh and DAPO's filter after
it, the rollout in flight and its recovery, the settings refused, and the cores an overlapped CPU run gives its engines."""

from __future__ import annotations

import dataclasses
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


def test_the_exact_overlap_trains_every_batch_at_staleness_zero():
    """trainer.overlap=exact: the same loop, with the rollout in flight refreshed under the weights the
    step trains from (refresh_rollout) when the step takes it; a batch collected in its own step is not."""
    cfg = _cfg("trainer.overlap=exact", "rollout.spec_mode=coupled", "rollout.coupled_refresh=1")
    run, ahead, lags, refreshed = _run(), RolloutAhead(), [], []

    def refresh(got):
        refreshed.append(got.version)
        return Collected(got.samples, got.rewards, got.metrics, run.version)

    for step in range(1, 41):
        got = (ahead.take(run, step, None, refresh) if ahead.holds(step)
               else Collected([], torch.zeros(0), {}, run.version))
        if starts_ahead(cfg, step):
            ahead.start(run, step + 1, lambda: ([], torch.zeros(0), {}))
        ahead.wait()
        lags.append(staleness(run.version, got.version)["async/staleness_max"])
        run.version += 1
    ahead.shutdown()
    assert lags == [0.0] * 40
    assert len(refreshed) == 40 - 3                 # every batch that ran ahead (not steps 1, 17, 33)


class _RefreshingRollout:
    def __init__(self):
        self.calls = []

    def refresh(self, samples, version, step):
        self.calls.append((version, step))
        return [s + "'" for s in samples], {"refresh/kept_token_frac": 0.9}


def test_a_refresh_rescores_the_batch_under_the_current_version():
    from megatron_specrl.run.overlap import refresh_rollout

    cfg = _cfg("trainer.overlap=exact", "rollout.spec_mode=coupled", "rollout.coupled_refresh=1")
    run = SimpleNamespace(version=5, rollout=_RefreshingRollout(), cfg=cfg,
                          score=lambda samples: (torch.ones(len(samples)), None, {"reward/mean": 1.0}))
    ahead = Collected(["a", "b"], torch.zeros(2), {"reward/mean": 0.0, "spec/decode_steps": 9.0}, 4, 1.0, 2.0)
    got = refresh_rollout(run, 6, ahead)
    assert run.rollout.calls == [(5, 6)] and got.samples == ["a'", "b'"] and got.version == 5
    assert got.rewards.tolist() == [1.0, 1.0] and got.metrics["reward/mean"] == 1.0
    assert got.metrics["spec/decode_steps"] == 9.0 and got.metrics["refresh/kept_token_frac"] == 0.9
    assert got.metrics["time/refresh_s"] >= 0 and (got.started, got.finished) == (1.0, 2.0)
    current = Collected(["c"], torch.zeros(1), {}, 5)
    assert refresh_rollout(run, 6, current) is current and len(run.rollout.calls) == 1   # of the current weights


def test_the_crash_tests_refresh_point_falls_between_the_engines_refresh_and_the_scoring():
    """SPECRL_KILL_AT=refresh:N kills with the refresh half done: the store and trees hold the refreshed
    responses, the rewards are not scored (tests/e2e/test_train_async.py resumes from there)."""
    from megatron_specrl import faults
    from megatron_specrl.run.overlap import refresh_rollout

    order = []

    class Hooks(faults.PhaseHooks):
        def before(self, phase, step):
            order.append((phase, step))

    cfg = _cfg("trainer.overlap=exact", "rollout.spec_mode=coupled", "rollout.coupled_refresh=1")
    run = SimpleNamespace(version=5, rollout=_RefreshingRollout(), cfg=cfg,
                          score=lambda samples: order.append("score") or (torch.ones(len(samples)), None, {}))
    refresh_rollout(run, 6, Collected(["a"], torch.zeros(1), {}, 4), Hooks())
    assert run.rollout.calls == [(5, 6)] and order == [("refresh", 6), "score"]
    assert "refresh" in faults.PHASES


# which samples of a group are correct, by (prompt, weight version): under w_0, the version the batch ahead is
# generated by, p0 and p1 are informative; under w_1, which the refresh samples, p0 is all-correct, p2
# all-wrong, and only p1 is; of the next round's (under w_1) p4 is the first informative group
_CORRECT = {("p0", 0): [1, 0], ("p1", 0): [1, 0], ("p2", 0): [1, 1],
            ("p0", 1): [1, 1], ("p1", 1): [1, 0], ("p2", 1): [0, 0],
            ("p3", 1): [0, 0], ("p4", 1): [1, 0], ("p5", 1): [0, 1]}


class _TableRollout:
    """Samples whose correctness _CORRECT gives by the weight version that drew them (the refresh's too)."""

    def __init__(self):
        self.runs, self.refreshes = [], []

    def run(self, prompts, n, version, step, next_prompts=()):
        from tests.helpers.rollouts import _sample
        self.runs.append((step, version, [pid for pid, _ in prompts]))
        samples = [_sample(pid, k, [version, k]) for pid, _ in prompts for k in range(n)]
        return [dataclasses.replace(s, weight_version=version, noise_seed=7) for s in samples], {"spec/decode_steps": 2.0}

    def refresh(self, samples, version, step):
        self.refreshes.append((step, version))
        return ([dataclasses.replace(s, response_ids=[version, s.sample_idx], weight_version=version) for s in samples],
                {"refresh/kept_token_frac": 0.5})


def _dapo_run(*overrides):
    cfg = _cfg("algorithm.dynamic_sampling=true", "trainer.prompts_per_step=2", "trainer.gen_prompts_per_step=3",
               "rollout.n_samples=2", *overrides)
    run = _run()
    ids = [f"p{i}" for i in range(6)]

    def next_prompts():
        run.loader.position += 3
        return [(pid, [1, 2]) for pid in ids[run.loader.position - 3:run.loader.position]]

    def score(samples):
        correct = torch.tensor([float(_CORRECT[s.prompt_id, s.weight_version][s.sample_idx]) for s in samples])
        return correct, correct, {"reward/mean": correct.mean().item()}

    run.__dict__.update(cfg=cfg, rollout=_TableRollout(), score=score, next_prompts=next_prompts,
                        upcoming_prompts=lambda: [])
    return run


def test_the_exact_overlap_filters_dapo_groups_on_their_refreshed_rewards_and_fills_under_the_new_weights():
    """Step 2's first round is generated ahead under w_0 beside step 1's training; after the resync to w_1
    it is refreshed, and only then does DAPO's filter judge it: the groups all-equal under w_1 (p0, p2) are
    dropped although w_0's samples of p0 were informative, and the round that fills the batch is generated
    under w_1, so every sample trained is w_1's (staleness 0)."""
    from megatron_specrl import trainer

    run = _dapo_run("trainer.overlap=exact", "rollout.spec_mode=coupled", "rollout.coupled_refresh=1")
    ahead = RolloutAhead()
    ahead.start(run, 2, lambda: trainer.collect_ahead(run, 2))
    ahead.wait()
    assert run.rollout.runs == [("2.0", 0, ["p0", "p1", "p2"])]   # the filter waits for the refresh
    run.version = 1                                                # step 1's train step and resync
    got = trainer.take_rollout(run, 2, ahead)
    ahead.shutdown()
    assert run.rollout.refreshes == [(2, 1)]
    assert run.rollout.runs[1:] == [("2.1", 1, ["p3", "p4", "p5"])]
    assert [s.prompt_id for s in got.samples] == ["p1", "p1", "p4", "p4"] and got.rewards.tolist() == [1, 0, 1, 0]
    assert {s.weight_version for s in got.samples} == {1} and got.version == 1
    assert staleness(run.version, got.version)["async/staleness_max"] == 0.0
    m = got.metrics
    assert m["dapo/rounds"] == 2 and m["dapo/groups_seen"] == 6 and m["refresh/kept_token_frac"] == 0.5
    assert m["spec/decode_steps"] == 4.0 and m["time/fill_rounds_s"] >= 0 and m["time/refresh_s"] >= 0


def test_the_stale_overlap_runs_dapos_rounds_ahead_under_the_old_weights():
    from megatron_specrl import trainer

    run = _dapo_run("trainer.overlap=stale")
    ahead = RolloutAhead()
    ahead.start(run, 2, lambda: trainer.collect_ahead(run, 2))
    ahead.wait()
    run.version = 1
    got = trainer.take_rollout(run, 2, ahead)
    ahead.shutdown()
    assert run.rollout.runs == [("2.0", 0, ["p0", "p1", "p2"])] and run.rollout.refreshes == []
    assert [s.prompt_id for s in got.samples] == ["p0", "p0", "p1", "p1"] and got.version == 0


def test_an_engine_lost_in_the_refresh_collects_the_batch_again():
    run, ahead = _run(version=3), RolloutAhead()
    ahead.start(run, 4, lambda: (["s"], torch.zeros(1), {}))

    def refresh(got):
        raise EngineError("engine core died", "vllm-0")

    got = ahead.take(run, 4, lambda state: Collected(["again"], torch.zeros(1), {}, run.version), refresh)
    assert got.samples == ["again"] and got.version == 3
    ahead.shutdown()


@pytest.mark.parametrize("overrides,error", [
    (["trainer.overlap=none", "trainer.max_staleness=1"], "trainer.overlap=none with trainer.max_staleness=1"),
    (["trainer.overlap=exact", "trainer.max_staleness=1", "rollout.spec_mode=coupled", "rollout.coupled_refresh=1"],
     "trainer.overlap=exact with trainer.max_staleness=1: the exact overlap trains every batch at staleness 0"),
    (["trainer.overlap=exact"], "trainer.overlap=exact with rollout.spec_mode=exact: the refresh re-verifies"),
    (["trainer.overlap=exact", "rollout.spec_mode=coupled"], "trainer.overlap=exact with rollout.coupled_refresh=0.0"),
    (["trainer.overlap=exact", "rollout.spec_mode=coupled", "rollout.coupled_refresh=1", "rollout.engine=sglang"],
     "rollout.spec_mode=coupled with rollout.engine=sglang"),
    (["trainer.overlap=stale", "learner.loss.tis=off"], "trainer.overlap=stale with learner.loss.tis=off"),
])
def test_impossible_overlap_settings_are_refused_in_one_line(overrides, error):
    from megatron_specrl.config.schema import ConfigError
    with pytest.raises(ConfigError) as err:
        _cfg(*overrides)
    assert error in str(err.value) and "\n" not in str(err.value).strip()


def test_max_staleness_still_means_the_stale_overlap():
    assert _cfg("trainer.max_staleness=1").trainer.overlap_mode == "stale"
    assert _cfg().trainer.overlap_mode == "none" and not _cfg().trainer.runs_ahead
    stale = _cfg("trainer.overlap=stale")
    assert stale.trainer.runs_ahead and stale.learner.recompute_old_logprobs is True   # the proximal policy
    exact = _cfg("trainer.overlap=exact", "rollout.spec_mode=coupled", "rollout.coupled_refresh=1")
    assert exact.trainer.runs_ahead and starts_ahead(exact, 1) and exact.learner.recompute_old_logprobs is False
    assert split_cores(exact, {}, cpus=[0, 1]) == "1"


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
    refreshed = Collected([], torch.zeros(0), {"time/refresh_s": 0.5}, 0, started=-2.0, finished=-0.5)
    assert step_times(0.0, 3.0, refreshed, None, 1.2)["time/engine_idle_s"] == 2.5   # the refresh is engine work


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
