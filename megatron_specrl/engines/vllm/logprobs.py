"""Reading vLLM's outputs into our results: a generated token's log-prob, and the verification columns
that patches/vllm_0_32_0_batched_prompt_logprobs.py writes into a verification request's prompt log-probs
(the producer's layout is described there; this module is its only reader).

vLLM hands log-probs over as `FlatLogprobs` (flat lists, no per-token objects: ~10% off a verification
prefill here) or, from the patch's output side, as `VerifyColumns` arrays; both are read here, so the
engine never looks inside either.
"""

from __future__ import annotations

import numpy as np

from megatron_specrl.engines.protocol import EngineError, GenerateResult, ScoreResult, check_finite_logprobs
from megatron_specrl.patches.vllm_0_32_0_batched_prompt_logprobs import UNCOMPUTED, VERIFY_COLUMNS


def token_logprobs(container, start: int, tokens: list[int]) -> list[float]:
    """Log-prob of tokens[j] at position start + j. `container` is vLLM's FlatLogprobs (flat
    lists, no per-token objects: ~10% off a verification prefill here) or a list of dicts."""
    if hasattr(container, "start_indices"):
        firsts, ids, lps = container.start_indices, container.token_ids, container.logprobs
        out = []
        for j, t in enumerate(tokens):
            i = firsts[start + j]
            if ids[i] != t:   # with 0 top log-probs each position holds just the given token
                raise RuntimeError(f"vLLM log-prob at position {start + j} is for token {ids[i]}, not {t}")
            out.append(float(lps[i]))
        return out
    return [float(container[start + j][t].logprob) for j, t in enumerate(tokens)]


def generate_result(out, weight_version: int, engine: str) -> GenerateResult:
    """A generation request's RequestOutput as our result; `out` None is a run-ahead request aborted before
    its first token. Non-finite log-probs are refused (protocol.check_finite_logprobs); `engine` names the
    engine in errors."""
    if out is None:
        return GenerateResult([], [], "abort", 0, weight_version)
    comp = out.outputs[0]
    toks = list(comp.token_ids)
    lps = token_logprobs(comp.logprobs, 0, toks) if comp.logprobs is not None else []
    if len(lps) != len(toks):
        raise EngineError(f"vLLM returned {len(lps)} log-probs for {len(toks)} tokens", engine)
    check_finite_logprobs(toks, lps, engine)
    return GenerateResult(
        token_ids=toks, logprobs=lps,
        finish_reason=comp.finish_reason if comp.finish_reason in ("length", "abort") else "stop",
        num_cached_tokens=int(out.num_cached_tokens or 0), weight_version=weight_version)


def _column_rows(container, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, log-probs), each [rows <= n, VERIFY_COLUMNS], for prompt positions start..start+n-1
    of a verification request. The patch's VerifyColumns already holds arrays (row i scores prompt
    token i + 1); vLLM's own FlatLogprobs (the output-side patch reverted) is read into the same
    layout, so one code path checks and uses the columns whichever container vLLM handed over."""

    if hasattr(container, "arrays"):
        ids, lps = container.arrays()
        return ids[start - 1:start - 1 + n], lps[start - 1:start - 1 + n]
    if not hasattr(container, "start_indices"):
        raise RuntimeError("verification needs flat prompt log-probs (SamplingParams.flat_logprobs=True)")
    firsts = np.asarray(container.start_indices[start:start + n], dtype=np.int64)
    widths = np.asarray(container.end_indices[start:start + n], dtype=np.int64) - firsts
    rows = int(np.argmin(widths == VERIFY_COLUMNS)) if (widths != VERIFY_COLUMNS).any() else len(firsts)
    cells = firsts[:rows, None] + np.arange(VERIFY_COLUMNS)
    return (np.asarray(container.token_ids, dtype=np.int64)[cells].reshape(rows, VERIFY_COLUMNS),
            np.asarray(container.logprobs, dtype=np.float32)[cells].reshape(rows, VERIFY_COLUMNS))


def verify_columns(container, start: int, tokens: list[int], stop_ids: frozenset[int],
                   weight_version: int, coupled: bool = False) -> ScoreResult:
    """ScoreResult from a verification request's prompt log-probs: per position the 4 columns
    (y, tempered), (y, processed), (r, tempered), (r, processed) of
    patches/vllm_0_32_0_batched_prompt_logprobs; r == y marks "no replacement" (-1 here), except
    for coupled requests, where r is the coupled draw and r == y means the draft token survives. A row
    with NaN / +inf log-probs has no replacement (-1) either way."""
    ids, lps = _column_rows(container, start, len(tokens))
    y = np.asarray(tokens, dtype=np.int64)
    ok = (ids[:, 0] == y[:len(ids)]) & (ids[:, 1] == y[:len(ids)])
    if len(ids) != len(tokens) or not ok.all():
        bad = int(np.argmin(ok)) if not ok.all() else len(ids)
        raise RuntimeError(f"vLLM verification columns at position {start + bad} do not hold the draft token "
                           f"{tokens[bad]} ({len(ids)} of {len(tokens)} rows have 4 columns): "
                           "is the batched prompt log-prob patch loaded in the workers?")
    r = ids[:, 2]
    if (r == UNCOMPUTED).any():           # the patch's mark for rows it did not compute
        raise RuntimeError(f"vLLM verification columns at position {start + int(np.argmax(r == UNCOMPUTED))} were "
                           "not computed (read from the prefix cache past the continuation's start?)")
    replacements = r if coupled else np.where(r != y, r, -1)
    # A row the model did not compute finitely (NaN / +inf logits: bf16 overflow, broken weights) has no
    # replacement: drawn from NaN probabilities it is an arbitrary token (the vocabulary's last; coupled:
    # token 0) with NaN log-probs, which the rollout took as the first new token at the rejection there
    # (acceptance rejects and counts a NaN) and handed to the learner and the store. Without one the
    # extension samples that position, and generate() refuses non-finite log-probs.
    broken = np.isnan(lps).any(axis=1) | np.isposinf(lps).any(axis=1)
    replacements = np.where(broken, -1, replacements)
    stops = np.isin(r, np.fromiter(stop_ids, dtype=np.int64, count=len(stop_ids))) & (replacements >= 0)
    lps = lps.astype(np.float64)
    return ScoreResult(lps[:, 0].tolist(), weight_version, lps[:, 1].tolist(), replacements.tolist(),
                       lps[:, 2].tolist(), lps[:, 3].tolist(), stops.tolist())
