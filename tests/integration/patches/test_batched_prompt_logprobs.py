"""The batched prompt-log-prob patch's chunk budget and chunk loop. No vLLM engine is

The tests of this subject that start processes or engines; the rest are in tests/unit/patches/test_batched_prompt_logprobs.py.
"""

from types import SimpleNamespace
import numpy as np
import pytest
import torch
import megatron_specrl.patches.vllm_0_32_0_batched_prompt_logprobs as P  # noqa: E402


VOCAB = 50


def _runner(logprobs_mode="raw_logprobs"):
    from vllm.v1.sample.sampler import Sampler

    calls = []

    def compute_logits(h):
        calls.append(len(h))
        return h.clone()

    return SimpleNamespace(model_config=SimpleNamespace(get_vocab_size=lambda: VOCAB, logprobs_mode=logprobs_mode),
                           model=SimpleNamespace(compute_logits=compute_logits), sampler=Sampler), calls


def _hidden(n, seed=1):
    return torch.from_numpy(np.random.default_rng(seed).normal(0, 3, (n, VOCAB)).astype(np.float32))


# (temperature, top_k, top_p, coupled noise seed, rows): runs of rows with top-k, top-p, neither,
# both, coupled; chunks of 3 rows see them alone and mixed
REQUESTS = [
    (0.7, VOCAB, 0.9, None, 5),
    (1.0, 7, 1.0, None, 4),
    (1.3, VOCAB, 1.0, None, 6),
    (0.9, 11, 0.8, 2**63 + 5, 7),
    (1.0, VOCAB, 1.0, 17, 3),
    (0.6, 5, 1.0, None, 2),
]


def _group(requests=REQUESTS, k=P.VERIFY_COLUMNS - 1, verify=True):
    from vllm.v1.outputs import LogprobsTensors

    from megatron_specrl.rollout.coupled import _i64

    rng = np.random.default_rng(3)
    group, offset = [], 0
    for j, (t, top_k, top_p, coupled, n) in enumerate(requests):
        prompt = 4 + j
        v = P._Verify(t, top_k, top_p, 100 + j, None if coupled is None else _i64(coupled), prompt) if verify else None
        dest = LogprobsTensors.empty_cpu(prompt + n, k + 1)
        targets = rng.integers(0, VOCAB, n).astype(np.int64)
        group.append(P._Rows(k, offset, n, targets, dest, slice(prompt - 1, prompt - 1 + n), v, prompt))
        offset += n + 2                        # rows of other requests between them
    return group, _hidden(offset)


def _results(group):
    return [(w.dest.logprob_token_ids[w.dest_slice].clone(), w.dest.logprobs[w.dest_slice].clone(),
             w.dest.selected_token_ranks[w.dest_slice].clone()) for w in group]


def _run_verify(monkeypatch, rows_per_chunk, requests=REQUESTS):
    monkeypatch.setattr(P, "chunk_rows", lambda device_type, free, vocab, buffers: rows_per_chunk)
    runner, calls = _runner()
    group, hidden = _group(requests)
    P._verify_group(runner, hidden, group)
    return _results(group), calls


def _assert_same(a, b):
    for (ids_a, lps_a, ranks_a), (ids_b, lps_b, ranks_b) in zip(a, b, strict=True):
        assert torch.equal(ids_a, ids_b)
        assert torch.equal(ranks_a, ranks_b)
        assert np.array_equal(lps_a.numpy().view(np.int32), lps_b.numpy().view(np.int32))   # bit for bit


def test_row_chunks_follow_the_budget(monkeypatch):
    seen = []

    def budget(device_type, free, vocab, buffers):
        seen.append((device_type, free, vocab, buffers))
        return 4

    monkeypatch.setattr(P, "chunk_rows", budget)
    runner, calls = _runner()
    group, hidden = _group()
    chunks = [(lo, hi) for lo, hi, _ in P._row_chunks(runner, hidden, group, buffers=P._VERIFY_BUFFERS)]
    total = sum(w.n for w in group)
    assert seen == [("cpu", None, VOCAB, P._VERIFY_BUFFERS)]
    assert chunks == [(lo, min(lo + 4, total)) for lo in range(0, total, 4)]
    assert calls == [hi - lo for lo, hi in chunks]


@pytest.mark.parametrize("rows_per_chunk", [1, 3, 8])
def test_verification_is_the_same_whatever_the_chunking(monkeypatch, rows_per_chunk):
    one, calls = _run_verify(monkeypatch, 10**9)
    assert len(calls) == 1
    chunked, calls = _run_verify(monkeypatch, rows_per_chunk)
    assert len(calls) == -(-sum(r[-1] for r in REQUESTS) // rows_per_chunk) > 1
    _assert_same(one, chunked)
    # the columns are computed ones: y in 0-1, a replacement or coupled draw in 2-3, finite log-prob of y
    for ids, lps, _ in one:
        assert (ids[:, 2:] >= 0).all() and (ids[:, 0] == ids[:, 1]).all() and torch.isfinite(lps[:, 0]).all()


def test_verification_matches_verify_rows_reading_the_tensors(monkeypatch):
    """The host-side decisions give what `verify_rows` decides from the device tensors (no hints)."""
    ((ids_g, lps_g, ranks_g),), _ = _run_verify(monkeypatch, 10**9, REQUESTS[3:4])
    runner, _ = _runner()
    (w,), hidden = _group(REQUESTS[3:4])
    v = w.verify
    rows = torch.arange(w.offset, w.offset + w.n)
    ids, lps, ranks = P.verify_rows(
        runner.model.compute_logits(hidden[rows]), torch.from_numpy(w.targets), torch.full((w.n,), v.temperature),
        torch.full((w.n,), v.top_k, dtype=torch.int32), torch.full((w.n,), v.top_p),
        torch.from_numpy(P.replacement_uniforms(v.seed, np.arange(w.first_target, w.first_target + w.n))),
        (torch.ones(w.n, dtype=torch.bool), torch.full((w.n,), v.coupled_seed),
         torch.arange(w.first_target, w.first_target + w.n) - v.start))
    _assert_same([(ids_g, lps_g, ranks_g)], [(ids.to(torch.int32), lps, ranks.to(torch.int32))])


def test_the_chunk_loop_reads_nothing_back_from_the_device(monkeypatch):
    """Whether rows use top-k / top-p or are coupled comes from the requests' settings: no `.all()`,
    `.any()` or `.nonzero()` on a tensor (a device-to-host sync on a GPU) per chunk."""
    reads = []
    for name in ("all", "any", "nonzero"):
        original = getattr(torch.Tensor, name)

        def spy(self, *a, _name=name, _original=original, **kw):
            reads.append(_name)
            return _original(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, spy)
    monkeypatch.setattr(P, "chunk_rows", lambda device_type, free, vocab, buffers: 3)
    runner, calls = _runner()
    group, hidden = _group()
    P._verify_group(runner, hidden, group)
    assert len(calls) > 5 and reads == []


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits"])
def test_plain_prompt_logprobs_are_the_same_whatever_the_chunking(monkeypatch, mode):
    out = []
    for rows_per_chunk in (10**9, 2):
        monkeypatch.setattr(P, "chunk_rows", lambda device_type, free, vocab, buffers, n=rows_per_chunk: n)
        runner, calls = _runner(logprobs_mode=mode)
        group, hidden = _group(k=2, verify=False)
        P._score_group(runner, hidden, 2, group)
        out.append(_results(group))
    _assert_same(*out)


