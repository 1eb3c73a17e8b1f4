"""Edge cases of the benchmark tools (reviews): replay_drafts' arguments past what the dumps hold,
bench-rollout's plot over every seed, bench_resync's model cache after an interrupted build.
No engine, no Megatron: synthetic dumps, fake per-epoch rows, a fake checkpoint writer."""

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from test_review_bench_tools_s19 import TOOLS, _rows, _tool


def _dump(directory, steps):
    directory.mkdir(parents=True, exist_ok=True)
    for step, rows in steps.items():
        (directory / f"{step}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return directory


def _replay_drafts(*args):
    return subprocess.run([sys.executable, str(TOOLS / "replay_drafts.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=120)


# -- tools/replay_drafts.py ------------------------------------------------------------------------

def test_replay_drafts_from_step_past_the_last_dump_is_refused_in_one_line(tmp_path):
    """--from-step past the last dumped step left nothing to summarise and crashed in
    statistics.fmean (StatisticsError) after replaying every step."""
    resp = list(range(1, 9))
    dumps = _dump(tmp_path / "rollouts", {s: _rows(s, [resp, resp]) for s in (1, 2, 3)})
    out = _replay_drafts(dumps, "--from-step", 40)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert out.stderr.strip() == f"--from-step 40: the dumps in {dumps} end at step 3"
    assert out.stdout == ""                       # refused before the replay's first line
    # the last dumped step itself is a valid start
    ok = _replay_drafts(dumps, "--from-step", 3)
    assert ok.returncode == 0 and "summary from step 3" in ok.stdout and "window all" in ok.stdout


@pytest.mark.parametrize("flag,value,message", [
    ("--window", "-1", "--window '-1': expected non-negative integers"),      # deque(maxlen=-1): ValueError
    ("--window", "1,,2", "--window '1,,2': expected non-negative integers"),  # int(''): ValueError
    ("--draft-tokens", "0", "--draft-tokens 0: expected an integer >= 1"),    # the trees' max_depth check
    ("--token-budget", "0", "--token-budget 0: expected an integer >= 1"),    # ZeroDivisionError
    ("--min-prob", "2", "--min-prob 2.0: expected a probability in [0, 1]"),  # ran, drafting uncut
    ("--max-new-tokens", "0", "--max-new-tokens 0: expected an integer >= 1"),  # ran, drafting nothing
])
def test_replay_drafts_refuses_out_of_range_settings_before_any_work(tmp_path, flag, value, message):
    """The other settings of the same class: each crashed with a traceback deep in the replay, or ran
    a policy the engine cannot run (its config bounds: draft_tokens >= 1, draft_token_budget >= 1,
    0 <= draft_min_prob <= 1, max_new_tokens > 0)."""
    resp = list(range(1, 9))
    dumps = _dump(tmp_path / "rollouts", {s: _rows(s, [resp, resp]) for s in (1, 2)})
    out = _replay_drafts(dumps, flag, value)
    assert out.returncode != 0 and "Traceback" not in out.stderr and out.stdout == ""
    assert out.stderr.strip().startswith(message) and len(out.stderr.strip().splitlines()) == 1


# -- megatron_specrl/bench_rollout.py: --plot ------------------------------------------------------

def _fake_runs(seeds=(7, 8), modes=("off", "tree"), epochs=3):
    """bench-rollout's `runs` (as its JSON holds them): per seed, per mode, per-epoch rows whose
    values tell seed, mode and epoch apart; no eval after epoch 1 (None, as per_epoch leaves it)."""
    return [{"seed": seed, "epochs": {m: [{"epoch": e, "rollout_s": 100 * seed + 10 * i + e,
                                           "reuse_ratio": (seed + i + e) / 100, "reward": seed + i + e / 10,
                                           "eval_accuracy": None if e == 1 else (seed + i) / 10 + e / 100}
                                          for e in range(1, epochs + 1)] for i, m in enumerate(modes)}}
            for seed in seeds]


def test_bench_rollout_plot_draws_every_seed(tmp_path):
    """With --seeds N > 1 the plot drew runs[0] only: the other seeds' curves, whose spread the
    tables report, were missing from it."""
    from megatron_specrl import bench_rollout

    runs = _fake_runs()
    series = bench_rollout.plot_series(runs)
    assert [seed for seed, _, _ in series["rollout_s"]["tree"]] == [7, 8]
    assert series["rollout_s"]["off"][1] == (8, [1, 2, 3], [801.0, 802.0, 803.0])
    assert math.isnan(series["eval_accuracy"]["off"][0][2][0])     # an epoch without an eval: a gap

    fig = bench_rollout.plot(runs, str(tmp_path / "curves.png"))
    assert (tmp_path / "curves.png").stat().st_size > 0
    rollout_ax = fig.axes[0]
    drawn = [(line.get_gid(), list(line.get_ydata())) for line in rollout_ax.get_lines()]
    for seed in (7, 8):
        for i, m in enumerate(("off", "tree")):
            assert (f"{m}/seed{seed}", [100 * seed + 10 * i + e for e in (1, 2, 3)]) in drawn
    means = dict(drawn)
    assert means["tree/mean"] == pytest.approx([(710 + 810) / 2 + e for e in (1, 2, 3)])
    # one colour per mode, every seed's line and the mean alike; the legend names each mode once
    colours = {}
    for line in rollout_ax.get_lines():
        colours.setdefault(line.get_gid().split("/")[0], set()).add(line.get_color())
    assert all(len(c) == 1 for c in colours.values()) and colours["off"] != colours["tree"]
    assert [t.get_text() for t in rollout_ax.get_legend().get_texts()] == ["off (mean)", "tree (mean)"]
    for ax in fig.axes:                                  # every panel: 2 modes x (2 seeds + mean)
        assert len(ax.get_lines()) == 6

    # one seed: one labelled line per mode, as before
    one = bench_rollout.plot(_fake_runs(seeds=(7,)), str(tmp_path / "one.png"))
    assert [(t.get_text(), list(line.get_ydata())) for t, line in
            zip(one.axes[0].get_legend().get_texts(), one.axes[0].get_lines())] == \
        [("off", [701, 702, 703]), ("tree", [711, 712, 713])]


# -- tools/bench_resync.py: the cached model -------------------------------------------------------

def test_bench_resync_never_reuses_a_half_written_model(tmp_path, monkeypatch):
    """The model was written straight into its cache directory, and a directory with config.json and
    a *.safetensors file was reused: a run killed inside save_pretrained left one (config.json first,
    a truncated safetensors file) that every later run measured. Now it is built aside and renamed
    into place (models.cache.build_once, the tiny models' cache)."""
    import transformers

    import megatron_specrl.models.tiny as tiny

    monkeypatch.setenv("MEGATRON_SPECRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tiny, "build_tokenizer", lambda out: SimpleNamespace(pad_token_id=0, eos_token_id=1,
                                                                              bos_token_id=2))
    calls = []

    class FakeModel:
        def save_pretrained(self, path, safe_serialization=True):
            calls.append(path)
            d = Path(path)
            (d / "config.json").write_text("{}")
            if len(calls) == 1:                     # killed half-way through the weights
                (d / "model.safetensors").write_bytes(b"partial")
                raise KeyboardInterrupt
            (d / "model.safetensors").write_bytes(b"complete")

    class FakeAuto:
        @staticmethod
        def from_config(cfg, dtype=None):
            assert cfg.hidden_size == 128 and cfg.num_hidden_layers == 1
            return FakeModel()

    monkeypatch.setattr(transformers, "AutoModelForCausalLM", FakeAuto)
    bench_resync = _tool("bench_resync")
    with pytest.raises(KeyboardInterrupt):
        bench_resync.build_bench_model(128, 1, 256, 300)
    out = bench_resync.build_bench_model(128, 1, 256, 300)
    assert len(calls) == 2                          # the interrupted build was not trusted: built again
    assert (out / "model.safetensors").read_bytes() == b"complete" and (out / "config.json").is_file()
    assert [p.name for p in out.parent.iterdir()] == [out.name]     # no temporary directory left behind
    # a complete model is reused as it is
    assert bench_resync.build_bench_model(128, 1, 256, 300) == out and len(calls) == 2
