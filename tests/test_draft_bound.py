"""tools/draft_bound.py: decode steps with the policy's own argmax continuation as the draft."""

import pytest

from tests.test_review_bench_tools_s19 import _tool

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
    from megatron_specrl.engines.tree_drafter import TreeDrafter

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
