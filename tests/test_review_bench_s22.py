"""Review (session 22) of the measurement code: bench-rollout's summary and driver, tools/replay_drafts.py's
decode-loop pricing, and the decode-step cost fit, fed synthetic per-epoch records and rollouts (no engine,
no training)."""

import json
from argparse import Namespace

import numpy as np
import pytest

from megatron_specrl import bench_rollout
from megatron_specrl.bench_rollout import epoch_table, per_epoch, spread, summarize
from megatron_specrl.engines.tree_drafter import TreeDrafter, add_step_cost, fit_step_cost
from test_review_bench_tools_s19 import _tool


def _epoch(epoch, **kw):
    e = {"epoch": epoch, "rollouts": 2, "rollout_s": 1.0, "verify_s": 0.0, "generate_s": 0.8, "loop_s": 0.6,
         "draft_s": 0.05, "draft_tokens": 100.0, "draft_accepted": 50.0, "request_steps": 100.0,
         "generated_tokens": 400.0, "accepted_tokens": 0.0, "replaced_tokens": 0.0, "reuse_ratio": 0.0,
         "tokens_per_step": 4.0, "decode_steps": 20.0, "reward": 0.5, "eval_accuracy": 0.4, "step_cost_sums": {}}
    e.update(kw)
    return e


def test_summary_tokens_per_step_is_the_ratio_of_the_steady_epochs_sums():
    """Generated tokens per request per decode step over epochs 3+ is total tree tokens / total
    request-steps, as every other ratio of the summary (reuse, draft acceptance, ms a decode step). It
    was the unweighted mean of the epochs' ratios: an epoch of few request-steps (the drafts finish
    most requests in a few steps) counted as much as one of many."""
    eps = [_epoch(1, tokens_per_step=1.0, request_steps=800.0),      # not steady: left out
           _epoch(2, tokens_per_step=1.0, request_steps=800.0),
           _epoch(3, tokens_per_step=10.0, request_steps=100.0),     # 1000 tokens
           _epoch(4, tokens_per_step=2.0, request_steps=300.0)]      # 600 tokens
    s = summarize({"tree": eps})
    assert s["tokens_per_step_tree"] == pytest.approx((1000 + 600) / (100 + 300))   # 4.0, not (10 + 2) / 2
    # from the step rows: the same as pooling every steady step's counters
    rows = [{"step": k + 1, "spec/rollout_s": 1.0, "spec/generated_tokens": g, "tree/generated_tokens": g,
             "tree/request_steps": r} for k, (g, r) in enumerate([(50, 50)] * 4 + [(500, 50)] * 2 + [(300, 150)] * 2)]
    s = summarize({"tree": per_epoch(rows, steps_per_epoch=2)})
    assert s["tokens_per_step_tree"] == pytest.approx((1000 + 600) / (100 + 300))
    # without drafting every epoch is 1 token a request-step, and stays 1
    assert summarize({"off": [_epoch(e, tokens_per_step=1.0) for e in (1, 2, 3, 4)]})["tokens_per_step_off"] == 1.0


def test_replay_prices_each_step_with_the_requests_the_engine_fit_counted_against_it():
    """The engine's drafter times each step from its call to the next and adds that interval to the fit
    with the requests of the step that starts it (add_step_cost(last step's requests, ...)): the prefill
    step's requests are in, the last step's are not. replay_drafts' decode-loop price (--step-cost) took
    the next step's requests (request_steps), so on the very steps a fit came from it read low by b x
    (prefill step's requests - last step's): 21 of 279 ms a rollout on the default bench's dump. The
    replay drives a TreeDrafter the way the engine does, so the drafter's own fit sums give the terms."""
    replay_drafts = _tool("replay_drafts")
    prompt = [100, 101]
    rows = [{"prompt_id": "p", "sample_idx": k, "prompt_ids": prompt, "response_ids": list(range(1, n + 1))}
            for k, n in enumerate((20, 12, 5))]          # requests ending at different steps
    d = TreeDrafter(4, 256, {"token_budget": 2048, "min_prob": 0.0})
    for tag in ("cold", "warm"):                          # a first rollout, then one drafted from the tree
        res = replay_drafts.replay_step(d, rows, tag)
        sums = d.take_stats()
        assert sums["cost_n"] == res["steps"] - 1
        a, b, c = 5.0, 0.5, 0.01
        assert replay_drafts.loop_ms([res], (a, b, c)) == pytest.approx(
            a * sums["cost_n"] + b * sums["cost_r"] + c * res["drafted"])
        # the three requests run in the prefill step, the longest one alone in the last
        assert res["cost_requests"] == sums["cost_r"] == res["request_steps"] + res["prefilled"] - 1
    assert res["drafted"] > 0 and res["steps"] < 20


def test_fit_step_cost_solves_the_same_least_squares_as_numpy():
    """The fit's normal equations from the summed moments (with Jacobi scaling) give numpy.linalg.lstsq's
    coefficients on the steps themselves, from a few steps to 10^5, with requests and draft tokens of
    very different size and nearly collinear."""
    rng = np.random.default_rng(22)
    for n, collinear in ((12, False), (500, False), (100_000, False), (400, True)):
        r = rng.integers(1, 257, n).astype(float)
        d = 10 * r + rng.integers(0, 3, n) if collinear else rng.integers(0, 17, n) * r
        y = (6.0 + 0.1 * r + 0.02 * d) / 1000 + rng.normal(0, 0.002, n)
        sums = {}
        for ri, di, yi in zip(r, d, y):
            add_step_cost(sums, ri, di, yi)
        ref = np.linalg.lstsq(np.column_stack([np.ones(n), r, d]), 1000 * y, rcond=None)[0]
        assert fit_step_cost(sums) == pytest.approx(tuple(ref), rel=1e-6, abs=1e-9)
    assert fit_step_cost({k: v * 9 / 12 for k, v in sums.items()} | {"cost_n": 9}) is None   # under 10 steps


def test_per_epoch_counts_dapos_generation_rounds():
    """DAPO rolls out up to max_sampling_tries batches a step and every per-step figure (rollout
    seconds, decode steps) sums them; each epoch now says how many rounds that was (dapo/rounds), so a
    DAPO speedup can be read per round, and the summary gives the rounds per step."""
    rows = [{"step": s, "spec/rollout_s": 1.0, "spec/decode_steps": 40.0 * n, "dapo/rounds": float(n)}
            for s, n in zip(range(1, 9), (1, 2, 2, 1, 2, 3, 1, 1))]
    eps = per_epoch(rows, steps_per_epoch=2)
    assert [e["rounds"] for e in eps] == [3, 3, 5, 2]
    assert [e["decode_steps"] for e in eps] == [60.0, 60.0, 100.0, 40.0]   # per step, over its rounds
    assert per_epoch([{"step": 1, "spec/rollout_s": 1.0}], steps_per_epoch=1)[0]["rounds"] == 1   # GRPO
    common = {"verify_s": 0.0, "generate_s": 0.5, "loop_s": 0.0, "draft_s": 0.0, "draft_tokens": 0.0,
              "draft_accepted": 0.0, "eval_accuracy": None}
    assert summarize({"off": [dict(e, **common) for e in eps]})["rounds_per_step_off"] == pytest.approx(7 / 4)


def test_epoch_table_shows_an_epoch_without_an_eval():
    """An epoch whose eval is missing (None) crashed the per-seed table (format of None), after every
    mode of the seed had trained and before the JSON was written."""
    args = Namespace(epochs=2, prompts=4, eval_prompts=8)
    results = {m: [_epoch(1, eval_accuracy=None), _epoch(2)] for m in ("off", "tree")}
    table = epoch_table(results, ["off", "tree"], args, 2, seed=1)
    assert table.row_count == 2


def test_bench_main_announces_each_run_and_writes_what_it_prints(monkeypatch, tmp_path, capsys):
    """--seeds N --seed S runs seeds S..S+N-1, every mode of a seed with the same seed; a line names each
    (seed, mode) run before it trains (the trainer's progress bar and step lines do not), and the JSON
    holds the per-seed summaries and their spread as printed."""
    calls = []

    def fake_run_mode(args, mode, seed, root, steps_per_epoch, console):
        calls.append((seed, mode, steps_per_epoch))
        console.print(f"TRAINING {seed} {mode}")
        fast = 1.0 if mode == "off" else 0.5 + 0.1 * (seed - 5)
        return [_epoch(e, rollout_s=fast if e >= 3 else 2.0) for e in range(1, args.epochs + 1)]

    monkeypatch.setattr(bench_rollout, "run_mode", fake_run_mode)
    out = tmp_path / "bench.json"
    assert bench_rollout.bench_rollout_main(["--modes", "off,tree", "--seeds", "2", "--seed", "5", "--epochs", "4",
                                             "--prompts", "8", "--prompts-per-step", "4", "--eval-prompts", "8",
                                             "--output-dir", str(tmp_path / "runs"), "--json", str(out)]) == 0
    assert calls == [(5, "off", 2), (5, "tree", 2), (6, "off", 2), (6, "tree", 2)]
    printed = capsys.readouterr().out
    lines = [ln for ln in printed.splitlines() if "TRAINING" in ln or ": run " in ln]
    assert lines[:2] == ["seed 5 off: run 1 of 4, 4 epochs x 2 steps", "TRAINING 5 off"]
    assert lines[-2:] == ["seed 6 tree: run 4 of 4, 4 epochs x 2 steps", "TRAINING 6 tree"]
    data = json.loads(out.read_text())
    assert data["config"]["seeds"] == [5, 6]
    assert [r["summary"]["speedup_tree"] for r in data["runs"]] == pytest.approx([2.0, 1 / 0.6])
    assert data["spread"] == spread([r["summary"] for r in data["runs"]])
    assert data["spread"]["speedup_tree"]["min"] == pytest.approx(1 / 0.6)
