"""bench-rollout's bookkeeping: epochs from step rows, the steady-state summary, a real smoke run.
"""

import json
import pytest
from megatron_specrl.benchmarks.rollout import bench_rollout_main, mode_overrides, per_epoch, spread, summarize

def _row(step, rollout_s, acc, gen, reward=0.5, **extra):
    return {"step": step, "spec/rollout_s": rollout_s, "spec/accepted_tokens": acc,
            "spec/generated_tokens": gen, "reward/mean": reward, "response/mean_len": 10.0, **extra}


def test_per_epoch_groups_steps_and_picks_the_epoch_end_eval():
    rows = [{"step": 0, "eval/accuracy": 0.25}]          # the step-0 eval row has no rollout
    rows += [_row(s, 1.0, 0, 100, **{"spec/decode_steps": 50.0}) for s in (1, 2)]
    rows += [_row(s, 0.5, 60, 40, **{"spec/decode_steps": 10.0, "spec/verify_s": 0.1, "tree/generated_tokens": 40.0,
                                     "tree/request_steps": 10.0, "spec/extend_s": 0.3, "tree/loop_s": 0.25,
                                     "tree/draft_s": 0.02, "tree/draft_tokens": 30.0, "tree/accepted_tokens": 12.0},
                  **({"eval/accuracy": 0.5} if s == 4 else {}))
             for s in (3, 4)]
    eps = per_epoch(rows, steps_per_epoch=2)
    assert [e["epoch"] for e in eps] == [1, 2]
    assert eps[0]["rollout_s"] == 2.0 and eps[0]["reuse_ratio"] == 0.0 and eps[0]["eval_accuracy"] is None
    assert eps[1]["rollout_s"] == 1.0 and eps[1]["reuse_ratio"] == pytest.approx(0.6)
    assert eps[1]["eval_accuracy"] == 0.5
    assert eps[0]["tokens_per_step"] == 1.0 and eps[1]["tokens_per_step"] == pytest.approx(4.0)
    assert eps[0]["decode_steps"] == 50.0 and eps[1]["decode_steps"] == 10.0
    assert eps[1]["verify_s"] == pytest.approx(0.2)
    assert eps[1]["rollouts"] == 2 and eps[1]["generate_s"] == pytest.approx(0.6)
    assert eps[1]["loop_s"] == pytest.approx(0.5) and eps[1]["draft_s"] == pytest.approx(0.04)
    assert (eps[1]["draft_tokens"], eps[1]["draft_accepted"]) == (60.0, 24.0)
    assert eps[0]["loop_s"] == eps[0]["generate_s"] == 0.0 and eps[0]["draft_tokens"] == 0.0   # not drafting
    assert eps[0]["request_steps"] == 200 and eps[1]["request_steps"] == 20   # a token each, or the drafter's count


def test_step_cost_sums_add_over_steps_and_epochs_and_fit_per_mode():
    """The engine's decode-step cost sums (tree_cost/*) are summed per epoch, the steady epochs' sums
    fitted per mode: ms = a + b requests + c draft tokens."""
    from megatron_specrl.rollout.tree_drafting.cost_model import add_step_cost

    rows = []
    for step in range(1, 7):
        sums = {}
        for r in range(1, 20):
            add_step_cost(sums, r, 10 * r + step, (6 + 0.1 * r + 0.02 * (10 * r + step)) / 1000)
        rows.append(_row(step, 1.0, 0, 10, **{f"tree_cost/{k[5:]}": v for k, v in sums.items()}))
    eps = per_epoch(rows, steps_per_epoch=2)
    assert eps[0]["step_cost_sums"]["cost_n"] == 2 * 19 and eps[2]["step_cost_sums"]["cost_d"] == sum(
        10 * r + s for s in (5, 6) for r in range(1, 20))
    common = {"verify_s": 0.0, "generate_s": 0.5, "loop_s": 0.4, "draft_s": 0.0, "draft_tokens": 1.0,
              "draft_accepted": 1.0, "eval_accuracy": None}
    s = summarize({"tree": [dict(e, **common) for e in eps]})
    assert (s["step_cost_ms_tree"], s["step_cost_ms_per_request_tree"], s["step_cost_ms_per_draft_token_tree"]) == \
        pytest.approx((6, 0.1, 0.02))
    assert "step_cost_ms_off" not in summarize({"off": [dict(eps[0], step_cost_sums={}, **common)] * 3})


def test_summary_counts_only_steady_epochs():
    common = {"tokens_per_step": 1.0, "decode_steps": 60.0, "reward": 0.4, "rollouts": 2, "request_steps": 480}
    off = [{"epoch": e, "rollout_s": 4.0, "accepted_tokens": 0, "generated_tokens": 100, "verify_s": 0.0,
            "generate_s": 3.5, "loop_s": 0.0, "draft_s": 0.0, "draft_tokens": 0.0, "draft_accepted": 0.0,
            "eval_accuracy": 0.3, **common} for e in range(1, 5)]
    fast = [{"epoch": e, "rollout_s": 4.0 if e < 3 else 1.0, "accepted_tokens": 0 if e < 3 else 90,
             "generated_tokens": 100 if e < 3 else 10, "verify_s": 0.4, "generate_s": 0.5, "loop_s": 0.3,
             "draft_s": 0.05, "draft_tokens": 100.0, "draft_accepted": 40.0, "eval_accuracy": 0.35, **common}
            for e in range(1, 5)]
    s = summarize({"off": off, "lenient": fast})
    assert s["speedup_lenient"] == pytest.approx(4.0)       # epochs 1-2 (slow) are not counted
    assert s["speedup_all_epochs_lenient"] == pytest.approx(16.0 / 10.0)   # ... except in the all-epochs ratio
    assert s["reuse_ratio_lenient"] == pytest.approx(0.9)
    assert s["final_eval_accuracy_lenient"] == 0.35
    assert s["verify_share_lenient"] == pytest.approx(0.8 / 8.0)   # verification vs off's steady rollout time
    # where the time goes, per rollout over the 4 steady rollouts: 0.2 verify + 0.25 generate + 0.05 other
    assert s["per_rollout_verify_s_lenient"] == pytest.approx(0.2)
    assert s["per_rollout_generate_s_lenient"] == pytest.approx(0.25)
    assert s["per_rollout_loop_s_lenient"] == pytest.approx(0.15) and s["per_rollout_draft_s_lenient"] == pytest.approx(0.025)
    assert s["per_rollout_other_s_lenient"] == pytest.approx(0.05)
    assert s["per_rollout_other_s_off"] == pytest.approx(0.25)
    assert s["ms_per_decode_step_lenient"] == pytest.approx(1000 * 1.0 / 240)
    # the drafter's own time per request and decode step: 2 x 0.05 s over 2 x 480 request-steps
    assert s["draft_us_per_request_step_lenient"] == pytest.approx(1e6 * 0.1 / 960)
    assert "draft_us_per_request_step_off" not in s
    assert s["ms_per_decode_step_off"] == pytest.approx(1000 * 7.0 / 240)
    assert s["draft_accept_rate_lenient"] == pytest.approx(0.4) and "draft_accept_rate_off" not in s
    assert s["running_per_step_lenient"] == pytest.approx(2 * 480 / 240)


def test_modes_and_seed_spread():
    pre = ["rollout.runahead=0", "rollout.verify=prefill"]
    assert mode_overrides("exact+tree") == ["rollout.spec_mode=exact", "rollout.draft=tree", *pre]
    assert mode_overrides("tree") == ["rollout.spec_mode=off", "rollout.draft=tree", *pre]
    assert mode_overrides("lenient") == ["rollout.spec_mode=lenient", "rollout.draft=none", *pre]
    assert mode_overrides("coupled+tree") == ["rollout.spec_mode=coupled", "rollout.draft=tree", *pre]
    assert mode_overrides("exact+tree+decode") == ["rollout.spec_mode=exact", "rollout.draft=tree",
                                                   "rollout.runahead=0", "rollout.verify=decode"]
    assert mode_overrides("exact+tree+decode+runahead")[2:] == ["rollout.runahead=64", "rollout.verify=decode"]
    assert mode_overrides("tree+runahead")[1:3] == ["rollout.draft=tree", "rollout.runahead=64"]
    assert mode_overrides("coupled+tree+runahead")[0] == "rollout.spec_mode=coupled"
    assert mode_overrides("tree+noshared") == ["rollout.spec_mode=off", "rollout.draft=tree", *pre,
                                               "rollout.drafter.shared_nodes=0"]
    assert mode_overrides("exact+tree+decode+noshared")[-2:] == ["rollout.verify=decode", "rollout.drafter.shared_nodes=0"]
    assert mode_overrides("exact+tree+decode+pytrees")[-2:] == ["rollout.verify=decode", "rollout.drafter.impl=python"]
    assert mode_overrides("tree+noshared+pytrees")[-2:] == ["rollout.drafter.shared_nodes=0", "rollout.drafter.impl=python"]
    assert mode_overrides("tree+pytrees+noshared")[-2:] == ["rollout.drafter.shared_nodes=0", "rollout.drafter.impl=python"]
    assert mode_overrides("exact+tree+decode+nocalib")[-2:] == ["rollout.verify=decode", "rollout.drafter.calibrate=false"]
    assert mode_overrides("exact+tree+decode+nocost")[-2:] == ["rollout.verify=decode", "rollout.drafter.cost_model=false"]
    for bad in ("exact+ngram", "exact+runahead", "coupled+runahead+tree", "lenient+tree+decode", "exact+decode",
                "exact+noshared", "noshared", "tree+noshared+runahead", "exact+pytrees", "tree+pytrees+pytrees",
                "tree+pytrees+runahead", "exact+nocalib", "tree+nocalib+nocalib", "exact+nocost"):
        with pytest.raises(SystemExit, match="unknown bench mode"):
            mode_overrides(bad)
    sp = spread([{"speedup_x": 2.0, "only_one": 1.0}, {"speedup_x": 3.0}])
    assert sp == {"speedup_x": {"mean": 2.5, "min": 2.0, "max": 3.0}}


@pytest.mark.slow
def test_bench_smoke_run_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    rc = bench_rollout_main(["--recipe", "tiny-cpu-grpo", "--modes", "off,tree", "--epochs", "3",
                             "--prompts", "4", "--prompts-per-step", "4", "--eval-prompts", "8",
                             "--output-dir", str(tmp_path / "runs"), "--json", str(out),
                             "model.warmup_steps=0", "rollout.n_samples=4", "rollout.max_new_tokens=16",
                             "rollout.drafter.cost_model=false",   # the bench's plumbing: drafts whatever a fit says
                             "learner.micro_batch_size=16"])
    assert rc == 0
    data = json.loads(out.read_text())
    (run,) = data["runs"]
    assert set(run["epochs"]) == {"off", "tree"} and len(run["epochs"]["tree"]) == 3
    assert data["machine"]["cores"] >= 1 and data["machine"]["vllm"] and data["machine"]["torch"]   # where it ran
    assert run["summary"]["reuse_ratio_off"] == run["summary"]["reuse_ratio_tree"] == 0.0   # no prefix reuse
    assert run["summary"]["speedup_tree"] > 0
    assert run["summary"]["tokens_per_step_off"] == 1.0
    assert run["summary"]["tokens_per_step_tree"] >= 1.0          # counted by the engine's tree proposer
    assert 0 < run["summary"]["decode_steps_tree"] <= 16 + 1
    # the engine's clocks: its decode loop lies inside the generation call, the drafter inside the loop
    t = run["summary"]
    assert 0 < t["per_rollout_draft_s_tree"] < t["per_rollout_loop_s_tree"] < t["per_rollout_generate_s_tree"]
    assert t["per_rollout_loop_s_off"] == 0.0 and t["per_rollout_generate_s_off"] > 0
    assert 0 <= t["draft_accept_rate_tree"] <= 1 and t["ms_per_decode_step_tree"] > 0
    assert t["draft_us_per_request_step_tree"] > 0 and "draft_us_per_request_step_off" not in t
    # decode-step cost sums: steps timed inside the decode loop, by the tree drafter only
    # (the first epoch runs undrafted on CPU: rollout.drafter.fresh_prompts, unset, drafts fresh prompts on GPUs only)
    first, *later = run["epochs"]["tree"]
    assert first["step_cost_sums"]["cost_n"] == 0 and first["draft_tokens"] == 0
    for e in later:
        assert 0 < e["step_cost_sums"]["cost_n"] < e["decode_steps"] * e["rollouts"] and 0 < e["step_cost_sums"]["cost_y"] <= e["loop_s"]
    assert all(e["step_cost_sums"]["cost_n"] == 0 for e in run["epochs"]["off"]) and "step_cost_ms_off" not in t
    assert 1 <= t["running_per_step_off"] <= 16 and 1 <= t["running_per_step_tree"] <= 16   # 4 prompts x 4 samples
    # the engine's requests, counted by the drafter: every sample once; a request runs at most the batch's steps
    assert all(e["requests"] == 16 * e["rollouts"] for e in run["epochs"]["tree"])
    assert 1 <= t["steps_per_request_tree"] <= t["decode_steps_tree"]
    assert all(e["eval_accuracy"] is not None for e in run["epochs"]["off"])
    # every mode dumps its rollouts (trainer.rollout_data_dir), one file a step, every sample's tokens
    from megatron_specrl.rollout.dump import read_rollouts
    dumped = read_rollouts(tmp_path / "runs" / f"seed{data['config']['seeds'][0]}" / "tree" / "rollouts")
    assert list(dumped) == [1, 2, 3] and all(len(rows) == 16 for rows in dumped.values())
    assert all(0 < len(r["response_ids"]) <= 16 and isinstance(r["score"], float) for r in dumped[3])
    assert data["spread"]["speedup_tree"]["min"] == data["spread"]["speedup_tree"]["max"]


def test_reuse_ratio_counts_the_verifications_replacement_tokens_as_not_reused():
    """Verified in a prefill (exact, coupled), a rejected draft's first new token is the verification's
    draw: in the response, neither accepted nor in spec/generated_tokens (the extension's). Reuse is
    the share of response tokens reused, so it belongs in the denominator; in the decode loop
    (rollout.verify=decode) the engine samples it and spec/generated_tokens already holds it."""
    # a step: 60 tokens accepted, 10 replacements drawn by the verification, 30 generated past them
    rows = [_row(s, 1.0, 60, 30, **{"spec/replaced_tokens": 10.0}) for s in (1, 2, 3)]
    (e,) = per_epoch(rows, steps_per_epoch=3)
    assert e["reuse_ratio"] == pytest.approx(60 / 100)
    (d,) = per_epoch(rows, steps_per_epoch=3, verify_in_decode=True)
    assert d["reuse_ratio"] == pytest.approx(60 / 90)
    common = {"verify_s": 0.0, "generate_s": 0.5, "loop_s": 0.0, "draft_s": 0.0, "draft_tokens": 0.0,
              "draft_accepted": 0.0}
    eps = [dict(e, epoch=k, **common) for k in (1, 2, 3, 4)]
    assert summarize({"exact": eps})["reuse_ratio_exact"] == pytest.approx(0.6)
