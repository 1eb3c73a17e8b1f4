"""The benchmark tools' arithmetic: benchmarks/replay_drafts.py and benchmarks/bench_own_draft.py,
fed synthetic rollouts and counters (no engine).

Edge cases of the benchmark tools (reviews): replay_drafts' arguments past what the dumps hold,
bench-rollout's plot over every seed, bench-resync's model cache after an interrupted build.
No engine, no Megatron: synthetic dumps, fake per-epoch rows, a fake checkpoint writer.

benchmarks/draft_bound.py: decode steps with the policy's own argmax continuation as the draft.

benchmarks/replay_drafts.py: the engine's decode loop replayed through a TreeDrafter on known tokens.

The measurement code: bench-rollout's summary and driver, benchmarks/replay_drafts.py's
decode-loop pricing, and the decode-step cost fit, fed synthetic per-epoch records and rollouts (no engine,
no training).

`megatron-specrl doctor` (diagnostics/doctor.py), what a GPU lease runs, stays runnable: on this CPU its learner checks run
over gloo and must pass (the same checks found two GPU bugs on an H200 on 2026-11-28).
"""

from __future__ import annotations
import importlib.util
from pathlib import Path
from types import SimpleNamespace
from megatron_specrl.rollout.tree_drafting.drafter import RequestOpts, TreeDrafter
import json
import math
import pytest
from argparse import Namespace
import numpy as np
from megatron_specrl.benchmarks import rollout as bench_rollout
from megatron_specrl.benchmarks.rollout import epoch_table, per_epoch, spread, summarize
from megatron_specrl.rollout.tree_drafting.cost_model import add_step_cost, fit_step_cost
import torch
from tests.helpers.paths import REPO_ROOT
from tests.helpers.benchmarks import _tool, _rows  # noqa: F401



# ---- The benchmark tools' arithmetic: benchmarks/replay_drafts.py and benchmarks/bench_own_draft.py,





SETTINGS = {"token_budget": 2048, "min_prob": 0.0}




def test_replay_drafts_no_further_than_the_engine_past_max_tokens():
    """Since 2026-11-24 the engine's drafter drafts no token past a request's max_tokens (the engine
    would verify tokens its scheduler then drops): a response of L = 8 tokens replayed from a tree
    that holds it drafts 6 tokens after the prefill's first (6 + 1 sampled = the 7 left), not 7. The
    replay ran its drafts on to max_model_len, so drafted, accepted, tokens verified per step and the
    --step-cost decode-loop time all read high for every response that reached max_tokens."""
    replay_drafts = _tool("replay_drafts")
    resp = list(range(1, 9))
    steps = {1: _rows(1, [resp]), 2: _rows(2, [resp])}
    assert replay_drafts.infer_max_new_tokens(steps) == 8
    assert replay_drafts.infer_max_new_tokens({1: _rows(1, [resp], finish="stop")}) is None
    out = replay_drafts.replay(steps, window=0, own_draft=False, settings=SETTINGS, max_k=16, max_model_len=256,
                               max_new_tokens=8)
    assert out[2]["steps"] == 2 and out[2]["drafted"] == 6 and out[2]["accepted"] == 6

    # the engine's own drafter, fed the same way with the engine's max_end, drafts the same 6
    d = TreeDrafter(16, 256, SETTINGS)
    d.trees.insert("p", resp)
    d.begin_step(1)
    draft = d.request("r", lambda: RequestOpts("p", 2, 2, max_end=2 + 8), lambda a, b: ([100, 101] + resp)[a:b], 3, 1)
    assert draft == resp[1:7]


class _FakeResult(SimpleNamespace):
    pass


def test_bench_own_draft_counts_the_plain_arms_engine_steps():
    """The tree drafter counts only steps where a request that opted in to drafting ran; `plain`'s
    requests do not opt in, so the tool printed 0.0 engine steps and 0.0 requests running / step for
    the plain arm (the baseline the drafting arms' steps are read against). Its steps follow from its
    outputs: the longest output's length, every output token a request-step."""
    bench_own_draft = _tool("bench_own_draft")
    zero = dict.fromkeys(("engine_steps", "request_steps", "generated_tokens", "draft_tokens", "cost_n"), 0.0)
    results = [_FakeResult(token_ids=list(range(n))) for n in (68, 40, 12)]
    plain = bench_own_draft.arm_counts(zero, results)
    assert plain["engine_steps"] == 68 and plain["request_steps"] == 120 and plain["generated_tokens"] == 120
    # a drafting arm keeps the drafter's own counts
    drafted = dict(zero, engine_steps=7.0, request_steps=20.0, generated_tokens=120.0, draft_tokens=300.0)
    assert bench_own_draft.arm_counts(drafted, results) == drafted






# ---- Edge cases of the benchmark tools (reviews): replay_drafts' arguments past what the dumps hold,





# -- benchmarks/replay_drafts.py ------------------------------------------------------------------------





# -- megatron_specrl/benchmarks/rollout.py: --plot ------------------------------------------------------

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
    from megatron_specrl.benchmarks import rollout as bench_rollout

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


# -- bench-resync (megatron_specrl/benchmarks/resync.py): the cached model -------------------------------------------------------

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
    from megatron_specrl.benchmarks import resync as bench_resync
    with pytest.raises(KeyboardInterrupt):
        bench_resync.build_bench_model(128, 1, 256, 300)
    out = bench_resync.build_bench_model(128, 1, 256, 300)
    assert len(calls) == 2                          # the interrupted build was not trusted: built again
    assert (out / "model.safetensors").read_bytes() == b"complete" and (out / "config.json").is_file()
    assert [p.name for p in out.parent.iterdir()] == [out.name]     # no temporary directory left behind
    # a complete model is reused as it is
    assert bench_resync.build_bench_model(128, 1, 256, 300) == out and len(calls) == 2


# ---- benchmarks/draft_bound.py: decode steps with the policy's own argmax continuation as the draft.

draft_bound = _tool("draft_bound")
replay_drafts = _tool("replay_drafts")


def test_chain_steps_follows_the_engines_step_rule():
    # a 20-token response whose drafts are always right: the prefill samples token 1, then each step
    # accepts a 4-token chain and samples one more: ceil(19 / 5) = 4 steps
    assert draft_bound.chain_steps([[True] * 20], lambda running: 4) == \
        {"steps": 5, "request_steps": 4, "accepted": 16, "drafted": 16, "first_drafted": 4, "first_accepted": 4,
         "cost_requests": 4}
    # never right: one token a step, as plain decoding
    assert draft_bound.chain_steps([[False] * 20], lambda running: 4)["steps"] == 20
    # a miss at position 3 ends the first chain after tokens 1-2; the rest is drafted whole
    hits = [True] * 12
    hits[3] = False
    out = draft_bound.chain_steps([hits], lambda running: 16)
    assert out["steps"] == 3 and out["accepted"] == 2 + 8 and out["first_accepted"] == out["first_drafted"] == 2
    # the longest request sets the steps; the draft length follows the requests the last step ran
    seen = []
    out = draft_bound.chain_steps([[False] * 3, [False] * 6, []], lambda running: seen.append(running) or 0)
    assert out["steps"] == 6 and out["request_steps"] == 2 + 5 and seen[:3] == [2, 2, 2] and seen[-1] == 1


def test_chain_steps_matches_the_tree_replay_on_the_same_hits():
    """With the trees holding the very responses, their drafts are the sampled tokens: replay_drafts'
    engine loop and chain_steps with every position a hit must agree step for step."""
    from megatron_specrl.rollout.tree_drafting.drafter import TreeDrafter

    responses = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]
    rows = [{"prompt_id": "p", "sample_idx": k, "prompt_ids": [100, 101], "response_ids": r}
            for k, r in enumerate(responses)]
    drafter = TreeDrafter(4, 256, {"token_budget": 2048, "min_prob": 0.0, "calibrate": False})
    replay_drafts.replay_step(drafter, rows, "old", None, 16)
    tree = replay_drafts.replay_step(drafter, rows, "new", None, 16)
    chain = draft_bound.chain_steps([[True] * len(r) for r in responses], drafter.draft_len)
    keys = ("steps", "request_steps", "accepted", "first_drafted", "first_accepted", "cost_requests")
    assert [tree[k] for k in keys] == [chain[k] for k in keys]


@pytest.mark.slow
def test_greedy_sampling_is_its_own_argmax_and_drafts_whole(tiny_llama, tmp_path):
    """At temperature 0 every sampled token is the argmax: the bound's per-token rate is 1 and its
    steps are the chain rule's on all-hit positions; the tool runs end to end on a real HF checkpoint."""
    import json

    out = tmp_path / "bound.json"
    assert draft_bound.main(["--model", str(tiny_llama), "--rounds", "1", "--prompts", "2", "--samples", "2",
                             "--max-new-tokens", "12", "--temperature", "0", "--step-cost", "5,0.1,0.01",
                             "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["argmax_token_rate"] == 1.0
    longest = r["plain"]["steps"]                    # plain decoding: one step a token of the longest response
    assert 1 <= longest <= 12
    assert r["argmax"]["steps"] == min(longest, 2)   # prefill + one step drafting the rest (K = 16 > 11)
    assert r["argmax"]["accepted"] == r["argmax"]["drafted"]          # every draft token accepted
    assert r["tree"]["steps"] >= r["argmax"]["steps"]
    # priced: the argmax loop is the chain's steps, requests and draft tokens at the given cost
    a = r["argmax"]
    assert r["loop_ms"]["argmax"] == pytest.approx(5 * (a["steps"] - 1) + 0.1 * a["cost_requests"] + 0.01 * a["drafted"])
    assert r["loop_ms"]["plain"] >= r["loop_ms"]["argmax"]


def test_a_bad_step_cost_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match="--step-cost '1,2': expected three numbers"):
        draft_bound.main(["--model", str(tmp_path), "--step-cost", "1,2"])


def test_a_bad_model_dir_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match="not an HF checkpoint directory"):
        draft_bound.main(["--model", str(tmp_path)])


@pytest.mark.slow
def test_a_draft_model_replays_as_its_own_greedy_chain(tiny_llama, tmp_path):
    """--draft-model: the policy as its own draft model is the argmax chain of the same length, step for
    step; an unrelated model's drafts are accepted less often (greedy samples: every own draft token is)."""
    import json

    from megatron_specrl.models.tiny import build_tiny_model
    other = build_tiny_model(tmp_path / "other", arch="llama", seed=7, num_layers=1)
    out = tmp_path / "bound.json"
    assert draft_bound.main(["--model", str(tiny_llama), "--rounds", "1", "--prompts", "2", "--samples", "4",
                             "--max-new-tokens", "16", "--temperature", "0", "--draft-model", str(tiny_llama),
                             "--draft-model", str(other), "--draft-model-tokens", "3", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    own, unrelated = r[f"model:{tiny_llama.name}"], r["model:other"]
    assert own == r["argmax@3"] and own["accepted"] == own["drafted"] > 0
    assert own["accepted"] > unrelated["accepted"] and unrelated["steps"] >= own["steps"]
    assert max(own["drafted"], unrelated["drafted"]) <= 3 * max(own["request_steps"], unrelated["request_steps"])


def test_a_draft_model_with_another_vocabulary_is_one_line(tiny_llama, tmp_path):
    (tmp_path / "config.json").write_text('{"vocab_size": 32000}')
    with pytest.raises(SystemExit, match=f"--draft-model {tmp_path}: vocab_size 32000 is not the policy's 264"):
        draft_bound.main(["--model", str(tiny_llama), "--draft-model", str(tmp_path)])


# ---- benchmarks/replay_drafts.py: the engine's decode loop replayed through a TreeDrafter on known tokens.

spec = importlib.util.spec_from_file_location("replay_drafts", REPO_ROOT / "benchmarks" / "replay_drafts.py")
replay_tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(replay_tool)



def _replay_rows(step, responses, prompt_id="p"):
    return [{"step": step, "prompt_id": prompt_id, "sample_idx": k, "prompt_ids": [100, 101], "response_ids": r}
            for k, r in enumerate(responses)]


def test_a_repeated_rollout_is_drafted_whole_and_a_new_one_token_by_token():
    resp = list(range(1, 21))
    steps = {1: _replay_rows(1, [resp, resp]), 2: _replay_rows(2, [resp, resp])}
    out = replay_tool.replay(steps, window=0, own_draft=False, settings=SETTINGS, max_k=4, max_model_len=256)
    # step 1: the siblings run in lockstep, neither ahead of the other: one token per engine step
    assert out[1]["steps"] == 20 and out[1]["accepted"] == 0
    # step 2: the tree holds the response: prefill + ceil(19 / (4 + 1)) steps, every draft token accepted
    assert out[2]["steps"] == 1 + 4 and out[2]["accepted"] == 2 * 4 * 4 and out[2]["drafted"] == 2 * 4 * 4
    assert out[2]["verified"] == 2 * 4 * (1 + 4)    # per request and step: its draft and one sampled token


def test_window_keeps_only_the_last_rollouts_and_own_drafts_follow_the_sample():
    a, b = [1, 2, 3, 4, 5, 6], [1, 2, 9, 9, 9, 9]
    steps = {1: _replay_rows(1, [a]), 2: _replay_rows(2, [b]), 3: _replay_rows(3, [a]), 4: _replay_rows(4, [a])}
    full = replay_tool.replay(steps, window=0, own_draft=False, settings=SETTINGS, max_k=8, max_model_len=256)
    last = replay_tool.replay(steps, window=1, own_draft=False, settings=SETTINGS, max_k=8, max_model_len=256)
    assert full[3]["steps"] < last[3]["steps"]      # step 3 repeats step 1, which a window of 1 has dropped
    assert full[4]["steps"] == last[4]["steps"] == 2   # step 3 is in both: prefill + one step drafting the rest
    # own draft: sample 0 of step 3 drafts its previous response (b) first, which leaves a after 2 tokens
    own = replay_tool.replay(steps, window=1, own_draft=True, settings=SETTINGS, max_k=8, max_model_len=256)
    assert own[3]["drafted"] > 0 and own[3]["accepted"] == 1    # "2" accepted, "9" rejected


def test_step_cost_turns_replayed_steps_into_decode_loop_time():
    resp = list(range(1, 21))
    out = replay_tool.replay({1: _replay_rows(1, [resp, resp]), 2: _replay_rows(2, [resp, resp])}, window=0, own_draft=False,
                               settings=SETTINGS, max_k=4, max_model_len=256)
    # step 2: 4 decode steps after the prefill, 2 requests in each, 32 draft tokens in all
    assert out[2]["request_steps"] == 8 and out[2]["drafted"] == 32
    assert replay_tool.loop_ms([out[2]], (5.0, 0.1, 0.01)) == 5.0 * 4 + 0.1 * 8 + 0.01 * 32
    # one draft token costing as much as a step: the drafted rollout's loop is dearer than the plain one's
    assert replay_tool.loop_ms([out[2]], (1.0, 0.0, 1.0)) > replay_tool.loop_ms([out[1]], (1.0, 0.0, 1.0))




def test_a_fitted_step_cost_with_a_slightly_negative_term_is_taken_as_printed():
    # bench_verify_cost prints a least-squares fit; a term near zero can come out below it
    assert replay_tool.parse_step_cost("8.42,-0.003,0.0103") == (8.42, -0.003, 0.0103)


def test_the_shared_tree_drafts_a_response_another_prompt_wrote():
    resp = list(range(1, 21))
    steps = {1: _replay_rows(1, [resp], prompt_id="p"), 2: _replay_rows(2, [resp], prompt_id="q")}
    shared = replay_tool.replay(steps, window=0, own_draft=False, settings=dict(SETTINGS, shared_nodes=1000),
                                  max_k=4, max_model_len=256)
    alone = replay_tool.replay(steps, window=0, own_draft=False, settings=dict(SETTINGS, shared_nodes=0),
                                 max_k=4, max_model_len=256)
    assert alone[2]["steps"] == 20 and alone[2]["drafted"] == 0      # q's own tree is empty
    assert shared[2]["steps"] == 1 + 4 and shared[2]["accepted"] == 16
    # with a window, the kept rollouts enter the shared tree too
    windowed = replay_tool.replay(steps, window=1, own_draft=False, settings=dict(SETTINGS, shared_nodes=1000),
                                    max_k=4, max_model_len=256)
    assert windowed[2]["steps"] == 20      # a window rebuilds per prompt: p's rollout is not q's history




def test_requests_running_per_step_counts_the_prefill_steps_requests():
    """The engine counts every step's requests, the prefill step's included (bench-rollout's
    "requests running / step"): two requests running through all of a rollout's steps run 2 a step."""
    resp = list(range(1, 21))
    out = replay_tool.replay({1: _replay_rows(1, [resp, resp]), 2: _replay_rows(2, [resp, resp])}, window=0, own_draft=False,
                               settings=SETTINGS, max_k=4, max_model_len=256)
    assert replay_tool.running_per_step([out[2]]) == 2.0      # prefill + 4 steps, both requests in each
    assert replay_tool.running_per_step([out[1], out[2]]) == 2.0
    one = replay_tool.replay({1: _replay_rows(1, [resp, [7]])}, window=0, own_draft=False, settings=SETTINGS,
                               max_k=4, max_model_len=256)
    # the one-token response ends in the prefill step: 2 requests there, 1 in each of the 19 others
    assert replay_tool.running_per_step([one[1]]) == pytest.approx((2 + 19) / 20)


def test_plain_decoding_of_the_same_responses_is_priced_a_step_a_token():
    """--step-cost also prices plain decoding of the replayed responses: the longest sets the steps and
    each interval counts the requests of the step that starts it (the prefill step's too), so the two
    loops' ratio is the decode-loop speedup under that cost."""
    short, long_ = list(range(1, 6)), list(range(1, 21))
    out = replay_tool.replay({1: _replay_rows(1, [long_, short]), 2: _replay_rows(2, [long_, short])}, window=0,
                               own_draft=False, settings=SETTINGS, max_k=4, max_model_len=256)
    assert out[2]["plain_steps"] == 20
    assert out[2]["plain_cost_requests"] == 2 * 5 + 1 * 14          # both for steps 1-5, the long one to 19
    assert replay_tool.plain_loop_ms([out[2]], (2.0, 0.5, 9.0)) == 2.0 * 19 + 0.5 * 24   # no draft tokens
    # drafts that cost nothing: the drafted loop (fewer steps) is cheaper than plain decoding
    assert replay_tool.loop_ms([out[2]], (2.0, 0.5, 0.0)) < replay_tool.plain_loop_ms([out[2]], (2.0, 0.5, 0.0))


# ---- The measurement code: bench-rollout's summary and driver, benchmarks/replay_drafts.py's

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
        assert fit_step_cost(sums)[:3] == pytest.approx(tuple(ref), rel=1e-6, abs=1e-9)
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


def test_bench_runs_each_engine_over_the_modes_it_can_and_compares_it_with_its_own_off(monkeypatch, tmp_path, capsys):
    """--engines vllm,sglang: every mode through each engine, labelled mode@engine, each run with its
    rollout.engine; on a CPU SGLang runs off / exact / lenient only (no tree drafts there, no coupled
    noise: its ENGINE_KINDS row) and says which it skips; a speedup is against the same engine's off."""
    calls = []

    def fake_run_mode(args, mode, seed, root, steps_per_epoch, console):
        calls.append(mode)
        slow = {"off@vllm": 2.0, "exact@vllm": 1.0, "off@sglang": 4.0, "exact@sglang": 1.0}.get(mode, 1.0)
        return [_epoch(e, rollout_s=slow) for e in range(1, args.epochs + 1)]

    monkeypatch.setattr(bench_rollout, "run_mode", fake_run_mode)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    out = tmp_path / "bench.json"
    assert bench_rollout.bench_rollout_main(["--engines", "vllm,sglang", "--modes", "off,exact,coupled,exact+tree",
                                             "--epochs", "3", "--prompts", "4", "--prompts-per-step", "4",
                                             "--eval-prompts", "0", "--output-dir", str(tmp_path / "runs"),
                                             "--json", str(out)]) == 0
    assert calls == ["off@vllm", "exact@vllm", "coupled@vllm", "exact+tree@vllm", "off@sglang", "exact@sglang"]
    assert "sglang skips coupled, exact+tree" in capsys.readouterr().out
    summary = json.loads(out.read_text())["runs"][0]["summary"]
    assert summary["speedup_exact@vllm"] == pytest.approx(2.0) and summary["speedup_exact@sglang"] == pytest.approx(4.0)
    assert bench_rollout.split_label("exact+tree@sglang") == ("exact+tree", "sglang")
    assert bench_rollout.split_label("exact") == ("exact", None) and bench_rollout.off_of("exact") == "off"


# ---- `megatron-specrl doctor` (diagnostics/doctor.py), what a GPU lease runs, stays runnable: on this CPU its learner checks run

ROOT = REPO_ROOT




def test_bench_verify_cost_runs_and_restores_the_cache():
    """benchmarks/bench_verify_cost.py (prepared for a GPU lease): a forward over q new tokens per sequence
    on a filled KV cache, cropped back each time (the tool asserts the cache length), on the tiny shape."""
    mod = _tool("bench_verify_cost")
    dev = torch.device("cpu")
    model, cfg = mod.build("tiny", torch.float32, dev)
    assert next(model.parameters()).dtype == torch.float32 and torch.get_default_dtype() == torch.float32
    cache = mod.filled_cache(cfg, batch=3, context=16, dtype=torch.float32, device=dev)
    for q in (1, 4):
        assert mod.step_ms(model, cache, 3, 16, q, dev, repeats=1) > 0
    assert cache.get_seq_length() == 16


def test_plan_matches_the_recorded_h200_peaks(tmp_path):
    """The plan check's learner memory against the peaks measured on an H200 (2026-11-28,
    docs/benchmarks/2026-11-28-h200-throughput.json; Megatron's local spec and torch's foreach AdamW, no
    TransformerEngine there). With full recompute the peak is the optimizer step's: torch's foreach AdamW
    holds an fp32 sqrt of every second moment, which the plan missed (10% low) until it counted it."""
    from transformers import LlamaConfig
    from megatron_specrl.diagnostics import doctor as mod
    rec = json.loads((ROOT / "docs" / "benchmarks" / "2026-11-28-h200-throughput.json").read_text())["throughput"]
    sh = rec["shape"]
    LlamaConfig(hidden_size=sh["hidden"], num_hidden_layers=sh["layers"], num_attention_heads=sh["heads"],
                num_key_value_heads=sh["kv"], intermediate_size=sh["inter"], vocab_size=sh["vocab"],
                max_position_embeddings=rec["T"]).save_pretrained(tmp_path)
    bf16 = {"precision": "bfloat16", "distributed_optimizer": True, "recompute_old_logprobs": True}
    plans = {tag: mod._plan_gib(tmp_path, rec["B"], rec["T"], kw) for tag, kw in (
        ("fp32", {}), ("bf16", bf16), ("bf16_recompute_selective", {**bf16, "recompute": "selective"}),
        ("bf16_recompute_full", {**bf16, "recompute": "full"}))}
    for tag, plan in plans.items():
        measured = rec[tag]["peak_train_gib"]
        assert abs(plan["total"] / measured - 1) < 0.05, (tag, plan, measured)
    # the step's temporaries set the full-recompute peak: without them the plan is 10% low there
    full = plans["bf16_recompute_full"]
    assert full["optimizer_step"] > full["activations"]
    assert (full["static"] + full["activations"]) / rec["bf16_recompute_full"]["peak_train_gib"] < 0.92


def test_adam_kind_follows_the_optimizer_the_learner_builds():
    """Replicated AdamW on GPUs is torch's foreach (an fp32 copy of the parameters in the step), the
    distributed optimizer on a GPU cluster TE's FusedAdam (none), CPU torch's per-tensor loop (one tensor)."""
    from megatron_specrl.config import load_config
    from megatron_specrl.plan import ModelShape, adam_kind, optimizer_step_bytes
    base = ROOT / "examples" / "tiny-cpu-grpo.yaml"
    assert adam_kind(load_config(base, [])) == "per_tensor"
    gpu = ["cluster.gpus_per_node=8"]
    assert adam_kind(load_config(base, gpu)) == "foreach"
    assert adam_kind(load_config(base, gpu + ["learner.distributed_optimizer=true"])) == "fused"
    s = ModelShape("llama", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=256, vocab=1000, tied=False,
                   qkv_bias=False, max_positions=128)
    assert optimizer_step_bytes(s, 1, 1024, 10_000, "foreach") == 40_000
    assert optimizer_step_bytes(s, 1, 1024, 10_000, "fused") == 0
    assert optimizer_step_bytes(s, 2, 1024, 10_000, "per_tensor") == 4 * 64 * 512   # the head's TP shard


def test_bench_verify_cost_fits_the_step_cost_replay_drafts_takes():
    """The GPU tool's fit over its (batch, q) grid recovers a known linear step cost, in the units
    benchmarks/replay_drafts.py --step-cost takes (ms a step, a request, a draft token)."""
    import pytest
    mod = _tool("bench_verify_cost")
    a, b, c = 6.0, 0.02, 0.003
    rows = [{"batch": n, "ms": {q: a + b * n + c * n * (q - 1) for q in (1, 4, 8, 16)}} for n in (32, 128, 256)]
    assert mod.fit_step_cost(rows) == pytest.approx((a, b, c), rel=1e-6)
    with pytest.raises(ValueError, match="needs 10"):
        mod.fit_step_cost(rows[:2])
