"""The engine loop's side of speculative decoding that vLLM's own `LLM.generate` does not cover: counting
a draft model's work (rollout.draft=model) from vLLM's metrics, and the run-ahead engine loop
(rollout.runahead, with tree drafting) that lets a later step's requests join a batch's tail.
"""

from __future__ import annotations

# vLLM's metric -> draft_stats' counter (rollout.draft=model); summed over the engine's cores
DRAFT_MODEL_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts",   # request-steps that verified a draft
                        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                        "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
                        "vllm:generation_tokens": "generated_tokens"}


def draft_model_counters(metrics) -> dict[str, float]:
    """A draft model's counters from `LLM.get_metrics()`: DRAFT_MODEL_COUNTERS and `engine_steps`, the
    engine's steps (one observation of vllm:iteration_tokens_total each). Cumulative since the engine
    started; generate() takes differences around a rollout's batch."""
    out = dict.fromkeys([*DRAFT_MODEL_COUNTERS.values(), "engine_steps"], 0.0)
    for m in metrics:
        if m.name in DRAFT_MODEL_COUNTERS:
            out[DRAFT_MODEL_COUNTERS[m.name]] += float(m.value)
        elif m.name == "vllm:iteration_tokens_total":
            out["engine_steps"] += float(m.count)
    return out



# run-ahead requests start once this fraction of the batch's other requests (or fewer) still run
RUNAHEAD_TAIL = 0.25


def generate_with_runahead(engine, prompts: list, params: list, runahead: list[bool]) -> list:
    """`LLM.generate` written out as vLLM's engine loop (`engine`: `LLM.llm_engine`), so that run-ahead
    requests can join when the batch reaches its tail (at most RUNAHEAD_TAIL of the other requests
    unfinished: the engine is under-used and a step costs about the same with more requests) and be
    aborted as soon as the last other request finishes. Outputs in input order; None for a run-ahead
    request that produced nothing."""
    import uuid

    from vllm.sampling_params import RequestOutputKind

    tag = uuid.uuid4().hex[:8]

    def add(i: int) -> str:
        """Queue request i under our own id (outputs and aborts use it; vLLM's internal id differs)."""
        params[i].output_kind = RequestOutputKind.FINAL_ONLY   # as LLM.generate sets it
        engine.add_request(f"specrl-{tag}-{i}", prompts[i], params[i])
        return f"specrl-{tag}-{i}"

    index: dict[str, int] = {}
    latest: dict[int, object] = {}
    started: list[str] = []
    try:
        for i, ra in enumerate(runahead):
            if not ra:
                index[add(i)] = i
        pending, waiting = set(index), [i for i, ra in enumerate(runahead) if ra]
        tail = max(1, int(RUNAHEAD_TAIL * len(pending)))
        while pending:
            if waiting and len(pending) <= tail:
                for i in waiting:
                    rid = add(i)
                    index[rid] = i
                    started.append(rid)
                waiting = []
            for out in engine.step():
                latest[index[out.request_id]] = out
                if out.finished:
                    pending.discard(out.request_id)
    except BaseException:
        # a request vLLM refused (or an interrupt) must not leave the others in the engine: the next
        # LLM.generate would run them and sort their outputs by int(request id)
        engine.abort_request([rid for rid, i in index.items() if not getattr(latest.get(i), "finished", False)])
        raise
    live = [rid for rid in started if not (latest.get(index[rid]) and latest[index[rid]].finished)]
    if live:
        engine.abort_request(live)
    while engine.has_unfinished_requests():   # let the engine core drop the aborted requests
        engine.step()
    return [latest.get(i) for i in range(len(prompts))]
