"""wandb after a resume: the steps replayed since the checkpoint must reach wandb, not be dropped.

A resumed run continues the same wandb run (one id per output_dir, resume="allow"), and wandb
ignores a `log(..., step=s)` with s below the run's current step. The fake below keeps that rule
(per run id, across inits) so the test needs no network and no wandb server."""

import sys
import types

from megatron_specrl.metrics import MetricsLogger


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


def _logger(out, resume_step, mode="online"):
    return MetricsLogger(out, {}, use_wandb=True, wandb_mode=mode, project="p", run_name=None,
                         resume_step=resume_step)


def test_steps_replayed_after_a_resume_reach_wandb(tmp_path, monkeypatch):
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=fake.init))
    first = _logger(tmp_path, 0)
    for step in (1, 2, 3, 4):                      # checkpoint at 2, killed after logging 4
        first.log(step, {"reward/mean": float(step)})
    second = _logger(tmp_path, 2)                  # resumed from the step-2 checkpoint: 3, 4 run again
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


def test_real_wandb_offline_accepts_the_step_metric(tmp_path, monkeypatch):
    """The calls above against the installed wandb, offline (no network): a resumed logger works
    and the step metric reaches the run's history file."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    first = _logger(tmp_path, 0, mode="offline")
    first.log(1, {"reward/mean": 1.0})
    first.close()
    second = _logger(tmp_path, 0 + 1, mode="offline")
    second.log(2, {"reward/mean": 2.0})
    second.close()
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith((tmp_path / "wandb_run_id").read_text()) for r in runs)
