"""vLLM 0.32.0: compute prompt log-probs for all requests of a step in one batch, and verify drafts
under the distribution the sampler draws from.

Why batch: speculative rollouts verify every draft with one prompt-log-prob prefill. vLLM's
`GPUModelRunner._get_prompt_logprobs_dict` loops over requests ("prompt logprobs are a rare
feature"), running compute_logits, log_softmax and the rank kernel once per request. With 128
drafts a step that loop costs more than the prefill itself (measured on CPU: verification
0.089 s vs 0.040 s for the same prefill without log-probs).

The replacement keeps the original bookkeeping per request (chunked prefill, preemption,
completed-request cleanup, the CPU tensors the output processor reads) and only batches the
math: the logit rows of every request are gathered into one index, processed in chunks whose
fp32 scores stay under a budget (a 150k vocab x 11k rows would otherwise need 7 GB), and scattered
back. For plain requests results are identical to the loop (tested). The budget is device-aware
(`chunk_rows`): 512 MiB on CPU; on CUDA a quarter of the free device memory, between 512 MiB and
4 GiB, because 512 MiB is only ~73 verification rows of a 152k vocabulary and a 16k-token prefill
would run ~220 chunks of small kernels one after another. The chunk loop never waits for the device:
which rows use top-k / top-p or are coupled is read from the requests' settings on the host, and
the results stay on the device until one non-blocking copy per request (vLLM's own pattern; the
caller's `_sync_device` completes them).

Verification requests (opt-in, nothing changes for any other request). vLLM computes prompt
log-probs from the raw logits ("prompt tokens skip sampling processors"), but a speculative
rollout must accept and resample under the distribution the sampler really draws from. A request
opts in with

    SamplingParams(prompt_logprobs=3, flat_logprobs=True, temperature=T, top_p=p, top_k=k,
                   extra_args={VERIFY_KEY: P, SEED_KEY: seed})

where P >= 1 is the prompt index of the first continuation token (True means 1: every position)
and `seed` seeds the replacement draws (default: the request's `seed`, else fresh randomness).
For every prompt position whose target token y = prompt[i] has i >= P, its 4 columns
(`prompt_logprobs=3` -> 3 + 1) then mean:

    col  token id  log-prob
    0    y         tempered:  log_softmax(logits / T)[y], the learner's convention (verl's actor);
                   the rank column is y's rank in it
    1    y         processed: log-prob of y under what the sampler draws from: logits / T, then
                   vLLM's own top-k / top-p masking (`apply_top_k_top_p`, as in `Sampler.sample`),
                   renormalised; -inf outside the nucleus
    2    r         tempered log-prob of r, a replacement for y drawn from the processed distribution
                   with y excluded and renormalised (the exact rule's resample at a rejection)
    3    r         processed log-prob of r (under the processed distribution, y not excluded)

r is drawn by inverse CDF with one uniform per position, a SplitMix64 hash of (seed, i): the same
seed gives the same replacements whatever the batch or the prefill chunking. A coupled request
(extra_args {COUPLED_KEY: noise seed}, rollout.spec_mode=coupled) gets instead, in columns 2-3, the
coupled draw c at response position i - P (megatron_specrl.rollout.coupled: argmax of the processed
log-probs plus position-keyed Gumbel noise; c may equal y), the token the decoder
(patches/vllm_0_32_0_coupled_sampling) would draw there under these weights. When the processed
distribution is a point mass on y there is no replacement: r = y and columns 2-3 are -inf.
Positions with i < P are not computed: tokens y, y, -1, -1 (UNCOMPUTED), log-probs NaN, rank 0.
Nothing full-vocabulary leaves the engine, and the front end's output processor hands a
verification request's columns over as arrays (`VerifyColumns`, `RequestOutput.prompt_logprobs`)
rather than one Python object per position. The columns need the flat container
(`flat_logprobs=True`): the dict form would merge the repeated token ids. Verification ignores `logprobs_mode` and logits processors
(the speculative rollout uses none).

A verification request may read the prefix cache (SamplingParams.skip_reading_prefix_cache=False,
which the engine sets when this patch is applied): the scheduler's lookup is capped at P - 1
(`_make_cache_cap`), so the n samples of a prompt share its prefill while every continuation row is
computed; rows a hit skipped are marked like those before P.

Pinned to vLLM 0.32.0 (the method's body is version-specific); on other versions `apply()`
leaves vLLM alone and returns False, and so does SPECRL_VLLM_BATCHED_PROMPT_LOGPROBS=0: without
the patch, verification requests are refused by the engine (`VLLMEngine.score`).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np
import torch

from megatron_specrl.patches.pinned import PinnedPatch

VERSION = "0.32.0"
_MAX_SCORE_BYTES = 512 << 20           # fp32 scores of a chunk: the budget on CPU, the floor on CUDA
_MAX_DEVICE_SCORE_BYTES = 4 << 30      # ... the cap on CUDA
_FREE_FRACTION = 0.25                  # ... of the device memory free after the forward pass
# fp32-equivalent (row x vocab) buffers alive at once while verifying a chunk: logits, tempered
# and processed log-probs, the top-k/top-p sort (values + int64 indices), probabilities, fp64 CDF
# (or, for coupled rows, the int64 noise keys and fp64 uniforms and Gumbel scores)
_VERIFY_BUFFERS = 12
VERIFY_KEY = "specrl_verify"
SEED_KEY = "specrl_seed"
COUPLED_KEY = "specrl_coupled_seed"    # shared with patches/vllm_0_32_0_coupled_sampling
VERIFY_COLUMNS = 4           # ask for prompt_logprobs = VERIFY_COLUMNS - 1
UNCOMPUTED = -1              # the replacement columns' token id in rows the patch did not compute


class _Verify(NamedTuple):
    """A verification request's sampling settings, read from its SamplingParams."""
    temperature: float
    top_k: int               # vocab size when top-k is off
    top_p: float
    seed: int | None
    coupled_seed: int | None = None   # columns 2-3 hold the coupled draw (noise of this seed)
    start: int = 1                    # prompt index of response position 0 (the first verified token)


class _Rows(NamedTuple):
    """One request's share of a step's prompt log-probs."""
    k: int                 # top log-probs asked for
    offset: int            # first hidden-state row of the request in this step
    n: int                 # rows (= prompt positions) to score
    targets: np.ndarray    # the prompt token at each next position
    dest: object           # the request's LogprobsTensors (CPU), read by the output processor
    dest_slice: slice      # where in `dest` these rows go (chunked prefill)
    verify: _Verify | None = None
    first_target: int = 0  # prompt index of targets[0] (seeds the replacement draws)


def continuation_start(sampling_params) -> int | None:
    """Prompt index of a verification request's first continuation token, None for other requests."""
    start = ((sampling_params.extra_args or {}) if sampling_params is not None else {}).get(VERIFY_KEY)
    if start is None or start is False:
        return None
    return max(1 if start is True else int(start), 1)


def _verify_settings(request, vocab: int) -> tuple[_Verify, int] | None:
    """(settings, first verified prompt index) of an opted-in request, else None."""
    sp = request.sampling_params
    start = continuation_start(sp)
    if start is None:
        return None
    extra = sp.extra_args or {}
    if sp.temperature <= 0:
        raise ValueError(f"{VERIFY_KEY} needs temperature > 0 (greedy has no distribution to verify)")
    top_k = sp.top_k if 0 < sp.top_k < vocab else vocab
    seed = extra.get(SEED_KEY, sp.seed)
    coupled = extra.get(COUPLED_KEY)
    if coupled is not None:
        # the 64-bit seed as the int64 the noise hashes: a seed >= 2**63 made its rows' array uint64, and
        # concatenated with other requests' int64 rows the whole batch's seeds went through float64
        from megatron_specrl.rollout.coupled import _i64
        coupled = _i64(int(coupled))
    return _Verify(float(sp.temperature), int(top_k), float(sp.top_p), None if seed is None else int(seed),
                   coupled, start), start


def _batched_prompt_logprobs_dict(self, hidden_states: torch.Tensor, num_scheduled_tokens: dict[str, int]):
    from vllm.v1.outputs import LogprobsTensors

    num_prompt_logprobs_dict = self.num_prompt_logprobs
    if not num_prompt_logprobs_dict:
        return {}

    prompt_logprobs_dict = {}
    completed_prefill_reqs = []
    work: list[_Rows] = []
    vocab = self.model_config.get_vocab_size()
    for req_id, num_prompt_logprobs in num_prompt_logprobs_dict.items():
        num_tokens = num_scheduled_tokens.get(req_id)
        if num_tokens is None:          # preempted in prefill
            continue
        request = self.requests[req_id]
        if request.prompt_token_ids is None:   # prompt embeddings: no prompt log-probs
            continue
        num_prompt_tokens = len(request.prompt_token_ids)
        logprobs_tensors = request.in_progress_prompt_logprobs_cpu
        if logprobs_tensors is None:
            logprobs_tensors = LogprobsTensors.empty_cpu(num_prompt_tokens - 1, num_prompt_logprobs + 1)
        start_idx = request.num_computed_tokens
        start_tok = start_idx + 1
        num_remaining_tokens = num_prompt_tokens - start_tok
        verify = _verify_settings(request, vocab)
        if verify is not None and request.in_progress_prompt_logprobs_cpu is None and start_idx:
            # a verification request that read the prefix cache (capped before its continuation by
            # `_make_cache_cap`): the cached prompt rows are not computed either
            _mark_unverified(logprobs_tensors, slice(0, start_idx), request.prompt_token_ids[1:start_tok])
        request.in_progress_prompt_logprobs_cpu = logprobs_tensors
        if num_tokens <= num_remaining_tokens:
            num_logits = num_tokens      # a chunk; more prompt tokens follow
        else:
            num_logits = num_remaining_tokens
            completed_prefill_reqs.append(req_id)
            prompt_logprobs_dict[req_id] = logprobs_tensors
        if num_logits <= 0:
            continue
        req_idx = self.input_batch.req_id_to_index[req_id]
        offset = int(self.query_start_loc.np[req_idx].item())
        skip = 0
        if verify is not None:
            verify, first = verify
            if num_prompt_logprobs != VERIFY_COLUMNS - 1:
                raise ValueError(f"a {VERIFY_KEY} request needs prompt_logprobs={VERIFY_COLUMNS - 1}, "
                                 f"got {num_prompt_logprobs}")
            # rows before the continuation are not verified (`_mark_unverified`)
            skip = min(max(first - start_tok, 0), num_logits)
            if skip:
                _mark_unverified(logprobs_tensors, slice(start_idx, start_idx + skip),
                                 request.prompt_token_ids[start_tok:start_tok + skip])
            if skip == num_logits:
                continue
        lo = start_tok + skip
        targets = np.asarray(request.prompt_token_ids[lo:start_tok + num_logits], dtype=np.int64)
        work.append(_Rows(num_prompt_logprobs, offset + skip, len(targets), targets, logprobs_tensors,
                          slice(start_idx + skip, start_idx + num_logits), verify, lo))

    for k in sorted({w.k for w in work if w.verify is None}):
        _score_group(self, hidden_states, k, [w for w in work if w.k == k and w.verify is None])
    verifying = [w for w in work if w.verify is not None]
    if verifying:
        _verify_group(self, hidden_states, verifying)

    for req_id in completed_prefill_reqs:
        del num_prompt_logprobs_dict[req_id]
        self.requests[req_id].in_progress_prompt_logprobs_cpu = None
    if prompt_logprobs_dict:
        self._sync_device()
    return prompt_logprobs_dict


def _mark_unverified(dest, rows: slice, tokens: list[int]) -> None:
    """Rows not computed (before the continuation, or read from the prefix cache): tokens y, y, -1, -1
    (no computed row has r < 0, so a reader can tell), log-probs NaN, rank 0."""
    tgt = torch.tensor(tokens, dtype=torch.int32)
    dest.logprob_token_ids[rows, :2].copy_(tgt.unsqueeze(1).expand(-1, 2))
    dest.logprob_token_ids[rows, 2:].fill_(UNCOMPUTED)
    dest.logprobs[rows].fill_(float("nan"))
    dest.selected_token_ranks[rows].fill_(0)


def chunk_rows(device_type: str, free_bytes: int | None, vocab: int, buffers: int) -> int:
    """Rows per chunk: `buffers` fp32 (row x vocab) buffers within the budget. On CPU the budget is
    `_MAX_SCORE_BYTES`; on CUDA `_FREE_FRACTION` of `free_bytes` (the device memory free to this
    process), at least `_MAX_SCORE_BYTES` and at most `_MAX_DEVICE_SCORE_BYTES`: fewer, larger
    chunks where the memory is there (a chunk costs ~20 kernel launches whatever its size)."""
    budget = _MAX_SCORE_BYTES
    if device_type == "cuda" and free_bytes is not None:
        budget = min(max(int(free_bytes * _FREE_FRACTION), _MAX_SCORE_BYTES), _MAX_DEVICE_SCORE_BYTES)
    return max(1, budget // (4 * buffers * max(vocab, 1)))


def _free_device_bytes(device: torch.device) -> int | None:
    """Device memory free to this process (CUDA only, else None): the driver's free memory plus the
    caching allocator's reserved but unused blocks (the forward pass's activations)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def _row_chunks(runner, hidden_states: torch.Tensor, group: list[_Rows], buffers: int):
    """(lo, hi, logits of rows lo:hi) over the group's rows, chunked to bound memory (`chunk_rows`)."""
    device = hidden_states.device
    rows = np.concatenate([np.arange(w.offset, w.offset + w.n, dtype=np.int64) for w in group])
    idx = torch.from_numpy(rows).to(device, non_blocking=True)     # once per group, sliced per chunk
    vocab = runner.model_config.get_vocab_size()
    chunk = chunk_rows(device.type, _free_device_bytes(device), vocab, buffers)
    for lo in range(0, len(rows), chunk):
        hi = min(lo + chunk, len(rows))
        yield lo, hi, runner.model.compute_logits(hidden_states.index_select(0, idx[lo:hi]))


def _scatter(group: list[_Rows], out_ids: torch.Tensor, out_lps: torch.Tensor, out_ranks: torch.Tensor) -> None:
    """The group's results (on the device) into each request's CPU tensors. As vLLM's loop does, the
    copies are non-blocking (`dest` is pinned where vLLM pins memory) and the runner's
    `_sync_device`, before any request's log-probs are handed over, completes them."""
    pos = 0
    for w in group:
        rows_of_w = slice(pos, pos + w.n)
        w.dest.logprob_token_ids[w.dest_slice].copy_(out_ids[rows_of_w], non_blocking=True)
        w.dest.logprobs[w.dest_slice].copy_(out_lps[rows_of_w], non_blocking=True)
        w.dest.selected_token_ranks[w.dest_slice].copy_(out_ranks[rows_of_w], non_blocking=True)
        pos += w.n


def _score_group(runner, hidden_states: torch.Tensor, k: int, group: list[_Rows]) -> None:
    """One compute_logits + log-softmax + gather per chunk of rows, for requests sharing k."""
    device = hidden_states.device
    targets = torch.from_numpy(np.concatenate([w.targets for w in group])).to(device, non_blocking=True)
    # results stay on the device until `_scatter` (no blocking copy per chunk)
    out_ids = torch.empty((len(targets), k + 1), dtype=torch.int64, device=device)
    out_lps = torch.empty((len(targets), k + 1), dtype=torch.float32, device=device)
    out_ranks = torch.empty(len(targets), dtype=torch.int64, device=device)
    for lo, hi, logits in _row_chunks(runner, hidden_states, group, buffers=1):
        if runner.model_config.logprobs_mode in ("raw_logits", "processed_logits"):
            scores = logits.to(torch.float32)
        else:
            scores = runner.sampler.compute_logprobs(logits)
        token_ids, logprobs, ranks, *_ = runner.sampler.gather_logprobs(scores, k, targets[lo:hi])
        out_ids[lo:hi].copy_(token_ids)
        out_lps[lo:hi].copy_(logprobs)
        out_ranks[lo:hi].copy_(ranks)
    _scatter(group, out_ids, out_lps, out_ranks)


def _verify_group(runner, hidden_states: torch.Tensor, group: list[_Rows]) -> None:
    """The 4 verification columns (module docstring) for every row of the opted-in requests."""
    device = hidden_states.device
    put = lambda a: torch.from_numpy(a).to(device, non_blocking=True)  # noqa: E731  (once per group)
    per_row = lambda f: np.concatenate([np.full(w.n, f(w.verify)) for w in group])  # noqa: E731
    # the host copies decide, chunk by chunk and without a device sync, which of vLLM's top-k / top-p
    # paths run and which rows are coupled (per chunk, as the device tensors decided it before)
    top_k_host = per_row(lambda v: v.top_k).astype(np.int32)
    top_p_host = per_row(lambda v: v.top_p).astype(np.float32)
    coupled_host = per_row(lambda v: v.coupled_seed is not None).astype(bool)
    targets, top_k, top_p = put(np.concatenate([w.targets for w in group])), put(top_k_host), put(top_p_host)
    temperature = put(per_row(lambda v: v.temperature).astype(np.float32))
    uniforms = put(np.concatenate([
        replacement_uniforms(w.verify.seed, np.arange(w.first_target, w.first_target + w.n)) for w in group]))
    coupled = None
    if coupled_host.any():
        seeds = per_row(lambda v: v.coupled_seed or 0).astype(np.int64)
        # the target at prompt index i is response position i - start
        positions = np.concatenate([
            np.arange(w.first_target, w.first_target + w.n) - w.verify.start for w in group]).astype(np.int64)
        coupled = (put(coupled_host), put(seeds), put(positions))
    # results stay on the device until `_scatter` (no blocking copy per chunk)
    out_ids = torch.empty((len(targets), VERIFY_COLUMNS), dtype=torch.int64, device=device)
    out_lps = torch.empty((len(targets), VERIFY_COLUMNS), dtype=torch.float32, device=device)
    out_ranks = torch.empty(len(targets), dtype=torch.int64, device=device)
    for lo, hi, logits in _row_chunks(runner, hidden_states, group, buffers=_VERIFY_BUFFERS):
        vocab = logits.shape[-1]
        ids, lps, ranks = verify_rows(
            logits, targets[lo:hi], temperature[lo:hi], top_k[lo:hi], top_p[lo:hi], uniforms[lo:hi],
            None if coupled is None else tuple(t[lo:hi] for t in coupled),
            top_k_off=bool((top_k_host[lo:hi] >= vocab).all()), top_p_off=bool((top_p_host[lo:hi] >= 1.0).all()),
            coupled_rows=None if coupled is None else np.flatnonzero(coupled_host[lo:hi]))
        out_ids[lo:hi].copy_(ids)
        out_lps[lo:hi].copy_(lps)
        out_ranks[lo:hi].copy_(ranks)
    _scatter(group, out_ids, out_lps, out_ranks)


def verify_rows(logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                top_p: torch.Tensor, uniforms: torch.Tensor, coupled: tuple | None = None, *,
                top_k_off: bool | None = None, top_p_off: bool | None = None,
                coupled_rows: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [R, V] and per-row targets (int64), temperature, top_k (V = off), top_p (1 = off),
    uniforms in [0, 1) (float64) -> token ids [R, 4], log-probs [R, 4], ranks [R] (docstring layout).
    `coupled` = (is_coupled [R] bool, noise seeds [R] int64, response positions [R] int64): those
    rows put the coupled draw in columns 2-3 instead of a replacement.
    What the caller knows on the host saves reading it back from the device: `top_k_off` /
    `top_p_off` (no row uses it, `tempered_and_processed`) and `coupled_rows` (the indices of the
    coupled rows, from is_coupled); left None they are read from the tensors.

    The processed distribution is built as `Sampler.sample` builds it: fp32 logits divided by the
    temperature, then `apply_top_k_top_p` (top_k / top_p None when no row uses them), then a
    log-softmax, so the nucleus is the one the sampler uses on this platform."""
    from vllm.v1.sample.sampler import Sampler

    vocab = logits.shape[-1]
    tempered, processed = tempered_and_processed(logits, temperature, top_k, top_p,
                                                 top_k_off=top_k_off, top_p_off=top_p_off)
    tgt = targets.unsqueeze(1)
    _, lp_y, ranks, *_ = Sampler.gather_logprobs(tempered, 0, targets)
    lp_y_proc = processed.gather(1, tgt)
    n_coupled = 0
    if coupled is not None:
        if coupled_rows is None:
            rows = coupled[0].nonzero().squeeze(1)          # a device sync
        elif len(coupled_rows) == len(targets):
            rows = torch.arange(len(targets), device=logits.device)
        else:
            rows = torch.from_numpy(np.asarray(coupled_rows, dtype=np.int64)).to(logits.device, non_blocking=True)
        n_coupled = rows.numel()
    if n_coupled and n_coupled == len(targets):
        ids, lps = _coupled_columns(tempered, processed, tgt, lp_y, lp_y_proc, rows, *coupled[1:])
        return ids, lps, ranks
    # r ~ processed distribution without y, renormalised: inverse CDF in fp64, one uniform per row
    probs = processed.exp()
    probs.scatter_(1, tgt, 0.0)
    cdf = probs.to(torch.float64).cumsum_(dim=1)
    del probs
    total = cdf[:, -1]
    # u * total may round up to total: stay below it, so the first cdf > x is a token of mass > 0
    x = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    r = torch.searchsorted(cdf, x.unsqueeze(1), right=True).squeeze(1)
    del cdf
    none = total <= 0                       # the nucleus is {y}: nothing to draw
    r = torch.where(none, targets, r.clamp_(max=vocab - 1)).unsqueeze(1)
    lp_r = tempered.gather(1, r).masked_fill_(none.unsqueeze(1), float("-inf"))
    lp_r_proc = processed.gather(1, r).masked_fill_(none.unsqueeze(1), float("-inf"))
    ids = torch.cat([tgt, tgt, r, r], dim=1)
    lps = torch.cat([lp_y, lp_y_proc, lp_r, lp_r_proc], dim=1)
    if n_coupled:                                       # a batch mixing coupled and exact requests
        c_ids, c_lps = _coupled_columns(tempered, processed, tgt, lp_y, lp_y_proc, rows, *coupled[1:])
        ids = torch.where(coupled[0].unsqueeze(1), c_ids, ids)
        lps = torch.where(coupled[0].unsqueeze(1), c_lps, lps)
    return ids, lps, ranks


def tempered_and_processed(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                           top_p: torch.Tensor, *, top_k_off: bool | None = None, top_p_off: bool | None = None,
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, V] log-probs of log_softmax(logits / T) (the learner's convention) and of what the sampler
    draws from: logits / T, vLLM's `apply_top_k_top_p` (top_k / top_p None when no row uses them),
    renormalised; -inf outside the nucleus. Per-row temperature, top_k (V = off), top_p (1 = off).
    `top_k_off` / `top_p_off`: whether no row uses it, when the caller knows it on the host (else
    read from the tensors, a device sync each). Also the coupled draw's distribution
    (patches/vllm_0_32_0_coupled_sampling), so verification and decoding truncate identically."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
    from vllm.v1.sample.sampler import Sampler

    vocab = logits.shape[-1]
    x = logits.to(torch.float32) / temperature.unsqueeze(1)
    tempered = Sampler.compute_logprobs(x)
    if top_k_off is None:
        top_k_off = bool((top_k >= vocab).all())
    if top_p_off is None:
        top_p_off = bool((top_p >= 1.0).all())
    k = None if top_k_off else top_k.clone()   # apply_top_k_only edits k in place
    p = None if top_p_off else top_p
    # x is masked in place; without truncation the processed distribution is the tempered one
    processed = tempered if k is None and p is None else Sampler.compute_logprobs(apply_top_k_top_p(x, k, p))
    return tempered, processed


def _coupled_columns(tempered, processed, tgt, lp_y, lp_y_proc, rows, seeds, positions):
    """(ids, log-probs) with columns 2-3 holding c, the coupled draw at that response position
    (megatron_specrl.rollout.coupled; it may equal y), for the coupled `rows` (indices, int64).
    Rows not coupled get c = y: the caller keeps its own columns for them."""
    from megatron_specrl.rollout.coupled import coupled_tokens

    c = tgt.squeeze(1).clone()
    if rows.numel():
        c[rows] = coupled_tokens(processed.index_select(0, rows), seeds[rows], positions[rows])
    c = c.unsqueeze(1)
    return (torch.cat([tgt, tgt, c, c], dim=1),
            torch.cat([lp_y, lp_y_proc, tempered.gather(1, c), processed.gather(1, c)], dim=1))


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.uint64, copy=True)
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z


def replacement_uniforms(seed: int | None, positions: np.ndarray) -> np.ndarray:
    """One uniform in [0, 1) per prompt position (float64): a SplitMix64 hash of (seed, position),
    so draws do not depend on batching or chunking. No seed: fresh randomness."""
    if seed is None:
        return np.random.default_rng().random(len(positions))
    with np.errstate(over="ignore"):
        key = _splitmix64(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))
        z = _splitmix64(key + (np.asarray(positions, dtype=np.uint64) + np.uint64(1)) * _GOLDEN)
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def enabled_by_env() -> bool:
    return os.environ.get("SPECRL_VLLM_BATCHED_PROMPT_LOGPROBS", "1") != "0"


def _runner():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    return GPUModelRunner


class VerifyColumns:
    """A verification request's prompt log-probs as two arrays, in place of vLLM's FlatLogprobs.

    Why: vLLM's output processor turns prompt log-probs into Python objects position by position
    (`LogprobsProcessor._update_prompt_logprobs`, ~6 us a position). A step verifies 128 drafts of
    ~90 tokens, 12k positions x 4 columns: that conversion cost about half as much as the prefill
    itself on CPU, only for `verify_columns` to read the numbers back. Opted-in requests keep the
    worker's tensors instead. Rows follow vLLM's prompt log-prob rows: row i scores prompt token
    i + 1 (the first prompt token has none), columns as in the module docstring."""

    def __init__(self):
        self._ids: list[np.ndarray] = []
        self._lps: list[np.ndarray] = []

    def add(self, token_ids: torch.Tensor, logprobs: torch.Tensor) -> None:
        self._ids.append(token_ids.numpy())
        self._lps.append(logprobs.numpy())

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(token ids [rows, VERIFY_COLUMNS], log-probs [rows, VERIFY_COLUMNS])"""
        if len(self._ids) != 1:
            self._ids = [np.concatenate(self._ids)] if self._ids else [np.zeros((0, VERIFY_COLUMNS), np.int64)]
            self._lps = [np.concatenate(self._lps)] if self._lps else [np.zeros((0, VERIFY_COLUMNS), np.float32)]
        return self._ids[0], self._lps[0]

    def __len__(self) -> int:             # positions, as a FlatLogprobs counts them
        return 1 + sum(len(a) for a in self._ids)


def _make_output_side(originals: dict) -> dict:
    """LogprobsProcessor: verification requests collect VerifyColumns, every other request is vLLM's."""
    from_new_request = originals["from_new_request"].__func__
    update = originals["_update_prompt_logprobs"]

    def new_request(cls, tokenizer, request):
        proc = from_new_request(cls, tokenizer, request)
        sp = request.sampling_params
        if proc.prompt_logprobs is not None and sp.flat_logprobs and continuation_start(sp) is not None:
            proc.prompt_logprobs = VerifyColumns()
        return proc

    def update_prompt_logprobs(self, prompt_logprobs_tensors):
        if isinstance(self.prompt_logprobs, VerifyColumns):
            token_ids, logprobs, *_ = prompt_logprobs_tensors
            self.prompt_logprobs.add(token_ids, logprobs)
            return
        update(self, prompt_logprobs_tensors)

    return {"from_new_request": classmethod(new_request), "_update_prompt_logprobs": update_prompt_logprobs}


def _logprobs_processor():
    from vllm.v1.engine.logprobs import LogprobsProcessor
    return LogprobsProcessor


def _make_cache_cap(originals: dict) -> dict:
    """KVCacheManager: a verification request may read the prefix cache, but only up to its
    continuation. Why: the n samples of a prompt are verified together, and without this each
    re-prefills the shared prompt (vLLM skips the cache for every prompt-log-prob request, since
    cached positions get no log-probs). The continuation's rows need the logits of positions
    P - 1 .. end, so the hit stops at P - 1 (block-aligned down by vLLM); a sibling's identical
    draft prefix is never read from the cache. The engine opts in per request with
    SamplingParams.skip_reading_prefix_cache=False."""
    lookup = originals["get_computed_blocks"]

    def get_computed_blocks(self, request):
        start = continuation_start(request.sampling_params)
        if start is None or request.skip_reading_prefix_cache:
            return lookup(self, request)
        coordinator = self.coordinator
        find = coordinator.find_longest_cache_hit
        coordinator.find_longest_cache_hit = lambda hashes, max_length: find(hashes, min(max_length, start - 1))
        try:
            return lookup(self, request)
        finally:
            del coordinator.find_longest_cache_hit

    return {"get_computed_blocks": get_computed_blocks}


def _kv_cache_manager():
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    return KVCacheManager


# Installed on GPUModelRunner (the CPU runner inherits it), on the front end's LogprobsProcessor and
# on the scheduler's KVCacheManager; off on other vLLM versions or with SPECRL_VLLM_BATCHED_PROMPT_LOGPROBS=0.
_PATCHES = (
    PinnedPatch(VERSION, _runner, ["_get_prompt_logprobs_dict"],
                lambda o: {"_get_prompt_logprobs_dict": _batched_prompt_logprobs_dict}, when=enabled_by_env),
    PinnedPatch(VERSION, _logprobs_processor, ["from_new_request", "_update_prompt_logprobs"], _make_output_side,
                when=enabled_by_env),
    PinnedPatch(VERSION, _kv_cache_manager, ["get_computed_blocks"], _make_cache_cap, when=enabled_by_env),
)


def apply() -> bool:
    return all([p.apply() for p in _PATCHES])


def revert() -> None:
    for p in _PATCHES:
        p.revert()


def is_applied() -> bool:
    """Whether verification works: the worker side. The output side only saves time."""
    return _PATCHES[0].is_applied()


def reads_prefix_cache() -> bool:
    """Whether verification requests may read the prefix cache up to their continuation."""
    return _PATCHES[0].is_applied() and _PATCHES[2].is_applied()
