"""MetricsLogger's JSONL: what a run starting at a given step keeps of an earlier run's rows.

metrics.jsonl across a crash: the resume-time truncation must never lose the rows it keeps.

wandb after a resume: the steps replayed since the checkpoint must reach wandb, not be dropped.

A resumed run continues the same wandb run (one id per output_dir, resume="allow"), and wandb
ignores a `log(..., step=s)` with s below the run's current step. The fake below keeps that rule
(per run id, across inits) so the test needs no network and no wandb server.

Resuming a checkpoint that is not this run's: one ConfigError naming the mismatch, raised
before Ray, the learner or any engine starts (no traceback from deep inside an actor).

DAPO's rounds merged into one step: the speculative ratios (mean accept length, reuse, full reuse)
are those of the step's summed counts, as if its rounds had been one rollout (an average over rounds
would weigh a round of two samples like one of eight).
"""

import json
from megatron_specrl.metrics.sinks import MetricsLogger, read_metrics
import sys
import types
import pytest
from megatron_specrl import checkpoint as ckpt
from megatron_specrl.config import ConfigError
import math
import torch
from megatron_specrl.engines.protocol import GenerateResult, SamplingSettings, ScoreResult
from megatron_specrl.rollout.dynamic import filter_rounds
from megatron_specrl.rollout.speculative import SpeculativeRollout
from megatron_specrl.rollout.store import Trajectory, TrajectoryStore
from tests.helpers.resume import _ReachedRay, _build, _checkpoint
from tests.helpers.wandb import _wandb_logger  # noqa: F401



# ---- MetricsLogger's JSONL: what a run starting at a given step keeps of an earlier run's rows.

def _logger(out, resume_step):
    return MetricsLogger(out, {}, use_wandb=False, wandb_mode="disabled", project="p", run_name=None,
                         resume_step=resume_step)


def test_a_run_from_step_0_keeps_no_row_of_an_earlier_run(tmp_path):
    """The trainer logs the step-0 eval whenever it starts at step 0 (fresh, or resumed before the
    first checkpoint): an earlier run's step-0 row must not stay beside it."""
    old = _logger(tmp_path, 0)
    for step, acc in ((0, 0.25), (1, 0.3), (2, 0.5)):
        old.log(step, {"eval/accuracy": acc})
    new = _logger(tmp_path, 0)
    new.log(0, {"eval/accuracy": 0.75})
    assert [(r["step"], r["eval/accuracy"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [(0, 0.75)]


def test_a_resumed_run_keeps_the_rows_up_to_its_checkpoint(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "x": 1.0}) + "\n" for s in range(4))
                                            + '{"step": 4, "x"')     # torn last line
    _logger(tmp_path, 2)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]


# ---- metrics.jsonl across a crash: the resume-time truncation must never lose the rows it keeps.



# ---- wandb after a resume: the steps replayed since the checkpoint must reach wandb, not be dropped.

class _FakeWandb:
    """wandb.init / Run.log / define_metric with wandb's step rule: a resumed run's step continues
    after the last logged one, and an explicit step below it is dropped."""

    def __init__(self):
        self.runs = {}           # id -> {"rows": [...], "next_step": int, "step_metrics": {}}
        self.init_kwargs = []

    def init(self, **kwargs):
        self.init_kwargs.append(kwargs)
        state = self.runs.setdefault(kwargs["id"], {"rows": [], "next_step": 0, "step_metrics": {}})
        fake = self

        class Run:
            def define_metric(self, name, step_metric=None, **_):
                state["step_metrics"][name] = step_metric

            def log(self, data, step=None, commit=None):
                if step is not None and step < state["next_step"]:
                    return               # "Tried to log to step s that is less than the current step"
                s = state["next_step"] if step is None else step
                state["rows"].append({"_step": s, **data})
                state["next_step"] = s + 1

            def finish(self):
                pass

        fake.last_run = Run()
        return fake.last_run




def test_steps_replayed_after_a_resume_reach_wandb(tmp_path, monkeypatch):
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=fake.init))
    first = _wandb_logger(tmp_path, 0)
    for step in (1, 2, 3, 4):                      # checkpoint at 2, killed after logging 4
        first.log(step, {"reward/mean": float(step)})
    second = _wandb_logger(tmp_path, 2)                  # resumed from the step-2 checkpoint: 3, 4 run again
    for step in (3, 4, 5):
        second.log(step, {"reward/mean": 10.0 * step})
    second.close()

    assert len({kw["id"] for kw in fake.init_kwargs}) == 1       # one wandb run per output_dir
    (state,) = fake.runs.values()
    logged = [(r.get("step"), r["reward/mean"]) for r in state["rows"]]
    for step in (3, 4, 5):                          # the replayed values are in wandb's history
        assert (step, 10.0 * step) in logged, logged
    # and plotted against the training step, not wandb's own counter of log calls
    assert state["step_metrics"].get("reward/mean", state["step_metrics"].get("*")) == "step"




# ---- Resuming a checkpoint that is not this run's: one ConfigError naming the mismatch, raised

def test_the_same_models_checkpoint_gets_past_the_checks(tmp_path, tiny_llama, monkeypatch):
    _checkpoint(tmp_path, tiny_llama)
    with pytest.raises(_ReachedRay):
        _build(tmp_path, tiny_llama, monkeypatch)


def test_another_models_checkpoint_is_refused(tmp_path, tiny_llama, monkeypatch):
    other = json.loads((tiny_llama / "config.json").read_text())
    other["num_hidden_layers"] += 2
    _checkpoint(tmp_path, tiny_llama, hf_config=other)
    with pytest.raises(ConfigError, match=r"model mismatch: checkpoint .*step_00000002.*\(num_hidden_layers \d+ vs \d+"):
        _build(tmp_path, tiny_llama, monkeypatch)


def test_a_checkpoint_over_other_data_is_refused(tmp_path, tiny_llama, monkeypatch):
    _checkpoint(tmp_path, tiny_llama, loader={"epoch": 0, "position": 8, "seed": 0, "shuffle": True,
                                              "num_records": 64})
    with pytest.raises(ConfigError, match=r"trainer.resume: checkpoint .*step_00000002.*num_records=64"):
        _build(tmp_path, tiny_llama, monkeypatch)


def test_ppo_from_a_checkpoint_without_a_critic_is_refused(tmp_path, tiny_llama, monkeypatch):
    _checkpoint(tmp_path, tiny_llama)
    with pytest.raises(ConfigError, match=r"checkpoint .*step_00000002 has no critic"):
        _build(tmp_path, tiny_llama, monkeypatch, "algorithm.name=ppo")


def test_another_optimizer_layout_is_refused_before_ray(tmp_path, tiny_llama, monkeypatch):
    """The learner refuses it too, but from inside its Ray actor: a RayTaskError traceback."""
    c = _checkpoint(tmp_path, tiny_llama)
    (c / "learner" / "specrl_learner.json").write_text(json.dumps(
        {"tp": 1, "pp": 1, "dp": 1, "role": "policy", "distributed_optimizer": True}))
    manifest = json.loads((c / ckpt.MANIFEST).read_text())
    manifest["files"]["learner/specrl_learner.json"] = ckpt.file_checksum(c / "learner" / "specrl_learner.json")
    (c / ckpt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"Megatron distributed optimizer state.*learner.distributed_optimizer=true"):
        _build(tmp_path, tiny_llama, monkeypatch)
    with pytest.raises(_ReachedRay):
        _build(tmp_path, tiny_llama, monkeypatch, "learner.distributed_optimizer=true")


def test_resume_never_in_an_earlier_runs_directory_is_refused(tmp_path, tiny_llama, monkeypatch):
    """trainer.resume=never there trimmed the earlier run's metrics.jsonl to nothing, overwrote its
    config.yaml, and left its later checkpoints for a resume=auto to continue: refused before writing."""
    _checkpoint(tmp_path, tiny_llama)
    (tmp_path / "config.yaml").write_text("earlier run\n")
    with pytest.raises(ConfigError, match=r"trainer.resume=never: .* holds an earlier run \(checkpoint step_00000002\)"):
        _build(tmp_path, tiny_llama, monkeypatch, "trainer.resume=never")
    assert (tmp_path / "config.yaml").read_text() == "earlier run\n"
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(ConfigError, match=r"holds an earlier run \(metrics.jsonl\)"):
        _build(fresh, tiny_llama, monkeypatch, "trainer.resume=never")
    with pytest.raises(_ReachedRay):                     # an empty directory starts
        _build(tmp_path / "empty", tiny_llama, monkeypatch, "trainer.resume=never")


# ---- DAPO's rounds merged into one step: the speculative ratios (mean accept length, reuse, full reuse)

EOS = 1
REJECTED = 12   # the engine's log-prob of this draft token makes acceptance impossible


class Engine:
    name = "scripted"
    weight_version = 1

    def score(self, requests, sampling, weight_version):
        return [ScoreResult([math.log(1e-12) if t == REJECTED else 0.0 for t in r.continuation_ids], 1)
                for r in requests]

    def generate(self, requests, sampling, weight_version):
        return [GenerateResult([50, 51, 52, EOS][: r.max_new_tokens], [-0.5] * min(4, r.max_new_tokens), "stop", 0, 1)
                for r in requests]


DRAFTS = {("p0", 0): [9, 10, 11, 13, 14, EOS],    # fully accepted (ends at EOS): the whole sample reused
          ("p0", 1): [9, 10, 11, 13, 14, EOS],
          ("p1", 0): [9, 10, REJECTED, 13, EOS]}  # two tokens accepted, then extended
ROUNDS = [["p0"], ["p1", "p2", "p3", "p4"]]       # 2 samples, then 8 (one of them drafted)


def _rollout():
    store = TrajectoryStore()
    for (pid, k), draft in DRAFTS.items():
        store.put(pid, k, Trajectory(draft, [-0.1] * len(draft), "stop", 0))
    return SpeculativeRollout(Engine(), store, mode="exact", lenience=1.0, sampling=SamplingSettings(),
                              max_new_tokens=8, seed=0)


def test_merged_spec_ratios_are_those_of_the_union_of_the_rounds():
    rollout = _rollout()

    def round_(i):
        samples, metrics = rollout.run([(pid, [5]) for pid in ROUNDS[i]], 2, 1, step=f"1.{i}")
        # round 0's only group is uninformative (all correct), round 1's groups are mixed
        rewards = torch.tensor([1.0] * len(samples) if i == 0 else [1.0, 0.0] * (len(samples) // 2))
        return samples, rewards, rewards.clone(), metrics

    _, _, merged = filter_rounds(round_, target_groups=1, max_tries=2)
    assert merged["dapo/rounds"] == 2
    _, union = _rollout().run([(pid, [5]) for r in ROUNDS for pid in r], 2, 1, step="1.0")

    assert union["spec/mean_accept_len"] == pytest.approx((6 + 6 + 2) / 3)
    assert union["spec/reuse_ratio"] == pytest.approx(14 / (6 + 6 + 6 + 4 * 7))
    assert union["spec/full_reuse_ratio"] == pytest.approx(2 / 10)
    for key in ("spec/mean_accept_len", "spec/reuse_ratio", "spec/full_reuse_ratio",
                "spec/accepted_tokens", "spec/drafts"):
        assert merged[key] == pytest.approx(union[key]), key


def test_lenient_bias_is_the_summed_excess_over_the_summed_accepted_tokens():
    from megatron_specrl.rollout.dynamic import _merge
    rounds = [{"spec/lenient_bias": 0.5, "spec/lenient_excess": 1.0, "spec/lenient_accepted_tokens": 2.0},
              {"spec/lenient_bias": 0.0, "spec/lenient_excess": 0.0, "spec/lenient_accepted_tokens": 98.0}]
    assert _merge(rounds)["spec/lenient_bias"] == pytest.approx(1.0 / 100.0)


def test_longest_response_is_the_longest_of_any_round_and_tree_sizes_are_the_last_rounds():
    from megatron_specrl.rollout.dynamic import _merge
    rounds = [{"response/max_len": 40.0, "tree/nodes": 100.0, "tree/memory_mb": 1.0, "reward/mean": 0.2},
              {"response/max_len": 10.0, "tree/nodes": 180.0, "tree/memory_mb": 1.5, "reward/mean": 0.4}]
    out = _merge(rounds)
    assert out["response/max_len"] == 40.0 and out["tree/nodes"] == 180.0 and out["tree/memory_mb"] == 1.5
    assert out["reward/mean"] == pytest.approx(0.3)
