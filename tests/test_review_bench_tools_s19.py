"""Review (session 19) of the benchmark tools' arithmetic: tools/replay_drafts.py and tools/bench_own_draft.py,
fed synthetic rollouts and counters (no engine)."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace


from megatron_specrl.engines.tree_drafter import RequestOpts, TreeDrafter

TOOLS = Path(__file__).parent.parent / "tools"


def _tool(name):
    spec = importlib.util.spec_from_file_location(f"{name}_s19", TOOLS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SETTINGS = {"token_budget": 2048, "min_prob": 0.0}


def _rows(step, responses, finish="length", prompt_id="p"):
    return [{"step": step, "prompt_id": prompt_id, "sample_idx": k, "prompt_ids": [100, 101], "response_ids": r,
             "finish_reason": finish} for k, r in enumerate(responses)]


def test_replay_drafts_no_further_than_the_engine_past_max_tokens():
    """Since session 18 the engine's drafter drafts no token past a request's max_tokens (the engine
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


class _Stepper:
    """Stands in for a vLLM class whose method --phases times."""
    calls = 0

    def step(self, x, scale=1):
        _Stepper.calls += 1
        return x * scale


def test_bench_own_draft_phases_name_vllms_methods_and_add_up_wall_time(monkeypatch):
    """`--phases` wraps vLLM methods by name: each must exist in the installed vLLM (a rename would
    otherwise fail only when someone runs the tool), and a wrapped method must return its result and
    add its seconds to its label on every call."""
    import importlib
    import time

    bench_own_draft = _tool("bench_own_draft")
    for path, name, _ in bench_own_draft.PHASES:
        module, cls = path.rsplit(".", 1)
        assert callable(getattr(getattr(importlib.import_module(module), cls), name)), (path, name)

    monkeypatch.setattr(bench_own_draft, "PHASES", ((f"{__name__}._Stepper", "step", "stepping"),))
    monkeypatch.setattr(_Stepper, "step", _Stepper.step)       # restored after the test
    monkeypatch.setattr(_Stepper, "calls", 0)
    totals = {}
    bench_own_draft.time_phases(totals)
    t = time.perf_counter()
    assert _Stepper().step(3, scale=2) == 6 and _Stepper().step(1) == 1
    elapsed = time.perf_counter() - t
    assert _Stepper.calls == 2 and set(totals) == {"stepping"} and 0 < totals["stepping"] <= elapsed
