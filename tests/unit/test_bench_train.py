"""bench-train's bookkeeping: what one run's rows give, the arms' overrides, refused arguments."""

import pytest

from megatron_specrl.benchmarks.train import ARMS, FIRST_TIMED_STEP, _parse, paired_with, summarize_run


def _rows():
    rows = [{"step": 0, "eval/accuracy": 0.4}]
    for step in range(1, 9):
        rows.append({"step": step, "time/step_s": 2.0 if step < FIRST_TIMED_STEP else 1.0 + step / 100,
                     "time/train_s": 0.5, "time/rollout_s": 0.4, "time/learner_idle_s": 0.5,
                     "time/engine_idle_s": 0.25, "async/staleness_mean": float(step > 1)})
    rows.append({"step": 8, "eval/accuracy": 0.5})
    return rows


def test_a_runs_figures_leave_the_warm_up_steps_out_of_the_medians_and_fractions():
    s = summarize_run(_rows(), wall_s=30.0)
    assert s["step_s_median"] == pytest.approx(1.065)          # steps 5-8: 1.05, 1.06, 1.07, 1.08
    assert s["loop_s"] == pytest.approx(4 * 2.0 + 1.05 + 1.06 + 1.07 + 1.08)
    assert s["learner_idle"] == pytest.approx(4 * 0.5 / (1.05 + 1.06 + 1.07 + 1.08))
    assert s["engine_idle"] == pytest.approx(4 * 0.25 / (1.05 + 1.06 + 1.07 + 1.08))
    assert s["staleness_mean"] == pytest.approx(7 / 8)
    assert (s["eval_start"], s["eval_end"], s["wall_s"]) == (0.4, 0.5, 30.0)


def test_the_arms_cross_the_loop_with_plain_and_speculative_rollouts():
    assert [a for a in ARMS if "trainer.max_staleness=1" in ARMS[a]] == ["async+off", "async+default"]
    assert all("rollout.spec_mode=off" in ARMS[a] for a in ("sync+off", "async+off"))
    assert not any(o.startswith("rollout.") for a in ("sync+default", "async+default") for o in ARMS[a])
    assert "trainer.overlap=exact" in ARMS["async+exact"] and "rollout.coupled_refresh=1" in ARMS["async+exact"]
    assert ARMS["sync+default+nocost"] == ARMS["sync+default"] + ["rollout.drafter.cost_model=false"]


def test_the_exact_overlaps_refresh_figures_come_from_the_steps_that_refreshed():
    rows = _rows()
    for r in rows[1:]:
        if r["step"] >= 6:
            r.update({"refresh/kept_token_frac": 0.9, "time/refresh_s": 0.2, "refresh/decode_steps": 2.0,
                      "spec/decode_steps": 10.0})
    s = summarize_run(rows, wall_s=30.0)
    assert s["refresh_kept_token_frac"] == pytest.approx(0.9) and s["refresh_decode_steps_ratio"] == pytest.approx(0.2)
    assert s["refresh_s_median"] == pytest.approx(0.2)               # steps 5-8: 0, 0.2, 0.2, 0.2
    assert summarize_run(_rows(), 30.0)["refresh_kept_token_frac"] == 0.0


def test_unknown_arms_and_too_few_steps_are_refused(capsys):
    with pytest.raises(SystemExit):
        _parse(["--arms", "sync+off,bogus"])
    assert "unknown arm(s) bogus" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse(["--steps", "3"])
    assert "--steps 3" in capsys.readouterr().err


def test_each_arm_is_compared_with_the_first_seed_by_seed():
    base = [{"step_s_median": 1.0, "rollout_s_median": 0.5, "eval_end": 0.50},
            {"step_s_median": 2.0, "rollout_s_median": 1.0, "eval_end": 0.60}]
    other = [{"step_s_median": 1.1, "rollout_s_median": 0.5, "eval_end": 0.53},
             {"step_s_median": 1.8, "rollout_s_median": 1.1, "eval_end": 0.59}]
    p = paired_with(base, other)
    # ratios within each seed: a slow seed in both arms does not count against the arm
    assert p["step_ratio"] == pytest.approx({"mean": 1.0, "min": 0.9, "max": 1.1})
    assert p["rollout_ratio"] == pytest.approx({"mean": 1.05, "min": 1.0, "max": 1.1})
    assert p["eval_end_diff"] == pytest.approx(0.01)
    # differences +0.03 and -0.01: standard deviation 0.04 / sqrt(2), standard error that / sqrt(2)
    assert p["eval_end_diff_error"] == pytest.approx(0.02)
    assert paired_with(base[:1], other[:1])["eval_end_diff_error"] == 0.0
    with pytest.raises(ValueError, match="1 base runs against 2"):
        paired_with(base[:1], other)
