"""Steps a request ran against the batch's steps: the tail that sets a drafted rollout's time.

The drafter counts the requests it saw start (run-ahead ones left out); `tree/steps_per_request` is
request_steps / requests, summed over a step's rounds like the other ratios; bench-rollout prints it
beside the decode steps (without drafting every sample is a request and runs a step per token).
Engine-free: the drafter as tests/test_drafter_accounting.py drives it.
"""

from test_drafter_accounting import PROMPT, _opts, _step

from megatron_specrl.bench_rollout import per_epoch, summarize
from megatron_specrl.engines.tree_drafter import TreeDrafter
from megatron_specrl.rollout.dynamic import _merge
from megatron_specrl.rollout.speculative import tree_metrics


class _Engine:
    def __init__(self, stats):
        self.stats = stats

    def draft_stats(self):
        return self.stats


def test_requests_counted_once_each_and_runahead_left_out():
    d = TreeDrafter(4, 256, {"min_prob": 0.0})
    a, b = PROMPT + [1], PROMPT + [1]
    _step(d, [("a", a, 1, 0, _opts()), ("b", b, 1, 0, _opts()), ("r", PROMPT + [7], 1, 0, _opts(runahead=True))])
    # b ends after its first step; a runs three more (a slow request: the batch's tail)
    for tok in (2, 3, 4):
        a = a + [tok]
        _step(d, [("a", a, 1, 0, _opts())])
    stats = d.take_stats()
    assert stats["requests"] == 2                      # a, b; the run-ahead request feeds trees only
    assert stats["request_steps"] == 5 and stats["engine_steps"] == 4
    m = tree_metrics(_Engine(stats))
    assert m["tree/requests"] == 2 and m["tree/steps_per_request"] == 2.5
    # the next rollout's counters start from zero
    assert d.take_stats()["requests"] == 0


def test_rounds_merge_steps_per_request_from_their_sums():
    rounds = [{"tree/request_steps": 30.0, "tree/requests": 10.0, "tree/steps_per_request": 3.0},
              {"tree/request_steps": 10.0, "tree/requests": 10.0, "tree/steps_per_request": 1.0}]
    merged = _merge(rounds)
    assert merged["tree/requests"] == 20.0 and merged["tree/steps_per_request"] == 2.0


def test_bench_reports_steps_per_request_beside_decode_steps():
    def row(step, tree):
        r = {"step": step, "spec/rollout_s": 1.0, "spec/decode_steps": 20.0, "spec/samples": 128.0,
             "spec/generated_tokens": 8000.0, "spec/accepted_tokens": 0.0}
        if tree:
            r.update({"tree/request_steps": 900.0, "tree/requests": 128.0, "tree/generated_tokens": 8000.0})
        return r
    tree = summarize({"m": per_epoch([row(s, True) for s in range(1, 9)], steps_per_epoch=2)})
    assert abs(tree["steps_per_request_m"] - 900 / 128) < 1e-9
    off = summarize({"off": per_epoch([row(s, False) for s in range(1, 9)], steps_per_epoch=2)})
    assert abs(off["steps_per_request_off"] - 8000 / 128) < 1e-9   # a step per token without drafting
