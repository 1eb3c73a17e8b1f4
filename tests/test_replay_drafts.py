"""tools/replay_drafts.py: the engine's decode loop replayed through a TreeDrafter on known tokens."""

import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("replay_drafts", Path(__file__).parent.parent / "tools" / "replay_drafts.py")
replay_drafts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(replay_drafts)

SETTINGS = {"token_budget": 2048, "min_prob": 0.0}


def _rows(step, responses, prompt_id="p"):
    return [{"step": step, "prompt_id": prompt_id, "sample_idx": k, "prompt_ids": [100, 101], "response_ids": r}
            for k, r in enumerate(responses)]


def test_a_repeated_rollout_is_drafted_whole_and_a_new_one_token_by_token():
    resp = list(range(1, 21))
    steps = {1: _rows(1, [resp, resp]), 2: _rows(2, [resp, resp])}
    out = replay_drafts.replay(steps, window=0, own_draft=False, settings=SETTINGS, max_k=4, max_model_len=256)
    # step 1: the siblings run in lockstep, neither ahead of the other: one token per engine step
    assert out[1]["steps"] == 20 and out[1]["accepted"] == 0
    # step 2: the tree holds the response: prefill + ceil(19 / (4 + 1)) steps, every draft token accepted
    assert out[2]["steps"] == 1 + 4 and out[2]["accepted"] == 2 * 4 * 4 and out[2]["drafted"] == 2 * 4 * 4
    assert out[2]["verified"] == 2 * 4 * (1 + 4)    # per request and step: its draft and one sampled token


def test_window_keeps_only_the_last_rollouts_and_own_drafts_follow_the_sample():
    a, b = [1, 2, 3, 4, 5, 6], [1, 2, 9, 9, 9, 9]
    steps = {1: _rows(1, [a]), 2: _rows(2, [b]), 3: _rows(3, [a]), 4: _rows(4, [a])}
    full = replay_drafts.replay(steps, window=0, own_draft=False, settings=SETTINGS, max_k=8, max_model_len=256)
    last = replay_drafts.replay(steps, window=1, own_draft=False, settings=SETTINGS, max_k=8, max_model_len=256)
    assert full[3]["steps"] < last[3]["steps"]      # step 3 repeats step 1, which a window of 1 has dropped
    assert full[4]["steps"] == last[4]["steps"] == 2   # step 3 is in both: prefill + one step drafting the rest
    # own draft: sample 0 of step 3 drafts its previous response (b) first, which leaves a after 2 tokens
    own = replay_drafts.replay(steps, window=1, own_draft=True, settings=SETTINGS, max_k=8, max_model_len=256)
    assert own[3]["drafted"] > 0 and own[3]["accepted"] == 1    # "2" accepted, "9" rejected


def test_step_cost_turns_replayed_steps_into_decode_loop_time():
    resp = list(range(1, 21))
    out = replay_drafts.replay({1: _rows(1, [resp, resp]), 2: _rows(2, [resp, resp])}, window=0, own_draft=False,
                               settings=SETTINGS, max_k=4, max_model_len=256)
    # step 2: 4 decode steps after the prefill, 2 requests in each, 32 draft tokens in all
    assert out[2]["request_steps"] == 8 and out[2]["drafted"] == 32
    assert replay_drafts.loop_ms([out[2]], (5.0, 0.1, 0.01)) == 5.0 * 4 + 0.1 * 8 + 0.01 * 32
    # one draft token costing as much as a step: the drafted rollout's loop is dearer than the plain one's
    assert replay_drafts.loop_ms([out[2]], (1.0, 0.0, 1.0)) > replay_drafts.loop_ms([out[1]], (1.0, 0.0, 1.0))


def test_a_bad_step_cost_is_refused_before_any_work(tmp_path):
    import subprocess
    import sys

    tool = Path(__file__).parent.parent / "tools" / "replay_drafts.py"
    out = subprocess.run([sys.executable, str(tool), str(tmp_path), "--step-cost", "8.4,0.18"],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "--step-cost '8.4,0.18': expected three numbers" in out.stderr


def test_a_fitted_step_cost_with_a_slightly_negative_term_is_taken_as_printed():
    # bench_verify_cost prints a least-squares fit; a term near zero can come out below it
    assert replay_drafts.parse_step_cost("8.42,-0.003,0.0103") == (8.42, -0.003, 0.0103)


def test_the_shared_tree_drafts_a_response_another_prompt_wrote():
    resp = list(range(1, 21))
    steps = {1: _rows(1, [resp], prompt_id="p"), 2: _rows(2, [resp], prompt_id="q")}
    shared = replay_drafts.replay(steps, window=0, own_draft=False, settings=dict(SETTINGS, shared_nodes=1000),
                                  max_k=4, max_model_len=256)
    alone = replay_drafts.replay(steps, window=0, own_draft=False, settings=dict(SETTINGS, shared_nodes=0),
                                 max_k=4, max_model_len=256)
    assert alone[2]["steps"] == 20 and alone[2]["drafted"] == 0      # q's own tree is empty
    assert shared[2]["steps"] == 1 + 4 and shared[2]["accepted"] == 16
    # with a window, the kept rollouts enter the shared tree too
    windowed = replay_drafts.replay(steps, window=1, own_draft=False, settings=dict(SETTINGS, shared_nodes=1000),
                                    max_k=4, max_model_len=256)
    assert windowed[2]["steps"] == 20      # a window rebuilds per prompt: p's rollout is not q's history


def test_a_bad_shared_nodes_is_refused_before_any_work(tmp_path):
    import subprocess
    import sys

    tool = Path(__file__).parent.parent / "tools" / "replay_drafts.py"
    for bad in ("1e6", "1000,-1"):
        out = subprocess.run([sys.executable, str(tool), str(tmp_path / "absent"), "--shared-nodes", bad],
                             capture_output=True, text=True)
        assert out.returncode != 0 and f"--shared-nodes {bad!r}: expected non-negative integers" in out.stderr


def test_requests_running_per_step_counts_the_prefill_steps_requests():
    """The engine counts every step's requests, the prefill step's included (bench-rollout's
    "requests running / step"): two requests running through all of a rollout's steps run 2 a step."""
    resp = list(range(1, 21))
    out = replay_drafts.replay({1: _rows(1, [resp, resp]), 2: _rows(2, [resp, resp])}, window=0, own_draft=False,
                               settings=SETTINGS, max_k=4, max_model_len=256)
    assert replay_drafts.running_per_step([out[2]]) == 2.0      # prefill + 4 steps, both requests in each
    assert replay_drafts.running_per_step([out[1], out[2]]) == 2.0
    one = replay_drafts.replay({1: _rows(1, [resp, [7]])}, window=0, own_draft=False, settings=SETTINGS,
                               max_k=4, max_model_len=256)
    # the one-token response ends in the prefill step: 2 requests there, 1 in each of the 19 others
    assert replay_drafts.running_per_step([one[1]]) == pytest.approx((2 + 19) / 20)


def test_plain_decoding_of_the_same_responses_is_priced_a_step_a_token():
    """--step-cost also prices plain decoding of the replayed responses: the longest sets the steps and
    each interval counts the requests of the step that starts it (the prefill step's too), so the two
    loops' ratio is the decode-loop speedup under that cost."""
    short, long_ = list(range(1, 6)), list(range(1, 21))
    out = replay_drafts.replay({1: _rows(1, [long_, short]), 2: _rows(2, [long_, short])}, window=0,
                               own_draft=False, settings=SETTINGS, max_k=4, max_model_len=256)
    assert out[2]["plain_steps"] == 20
    assert out[2]["plain_cost_requests"] == 2 * 5 + 1 * 14          # both for steps 1-5, the long one to 19
    assert replay_drafts.plain_loop_ms([out[2]], (2.0, 0.5, 9.0)) == 2.0 * 19 + 0.5 * 24   # no draft tokens
    # drafts that cost nothing: the drafted loop (fewer steps) is cheaper than plain decoding
    assert replay_drafts.loop_ms([out[2]], (2.0, 0.5, 0.0)) < replay_drafts.plain_loop_ms([out[2]], (2.0, 0.5, 0.0))
