"""vLLM 0.32.0: coupled sampling, where a request draws the token at response position t with noise that
depends only on (its noise seed, t) (megatron_specrl.rollout.coupled).

Why a patch: vLLM's seeded requests advance one torch.Generator per engine step, so an extension
that starts at response position n gets the noise of position 0, and speculative decoding's
rejection sampler draws with other noise again. A coupled rollout needs the same noise at position t
whether t is decoded from the prompt, from an accepted prefix, verified in a prefill, or proposed by
a draft tree.

A request opts in with SamplingParams(extra_args={COUPLED_KEY: seed, RESPONSE_START: s}), s being the
prompt index where the response starts (an extension's prompt ends with the accepted part of the
response). Then, in `GPUModelRunner._sample` (the CPU runner inherits it):

- plain decode: after vLLM's sampler has run, the coupled requests' tokens are replaced by
  argmax_v processed_logprob(v) + G(seed, t, v), computed from a copy of their logits taken before the
  sampler edits them in place, and their returned log-probs and ranks are recomputed for the new token;
- speculative decoding (draft trees): per coupled request with drafts d_1..d_k, the coupled tokens
  c_1..c_{k+1} at the k draft positions and the bonus position are computed the same way; the output
  is c_1..c_m where m is the first j with d_j != c_j (or k + 1): exactly the tokens plain coupled
  decoding would produce, whatever the draft. vLLM's own rejection sampling is overwritten for these
  rows, together with their log-probs.

The processed distribution is `tempered_and_processed` of the batched prompt-log-prob patch, so the
verification prefill (which computes the coupled draw at every position of an old response) and the
decoder truncate and renormalise identically. Requests without the key are untouched. Pinned to vLLM
0.32.0: on other versions `apply()` leaves vLLM alone and returns False.
"""

from __future__ import annotations

import numpy as np
import torch

from megatron_specrl.rollout.tree_drafting.drafter import RESPONSE_START
from megatron_specrl.patches.pinned import PinnedPatch
from megatron_specrl.patches.vllm_0_32_0_batched_prompt_logprobs import COUPLED_KEY, tempered_and_processed

VERSION = "0.32.0"
__all__ = ["COUPLED_KEY", "RESPONSE_START", "apply", "revert", "is_applied"]


_NOT_READ = object()


def _coupled_setting(req) -> tuple[int, int, object] | None:
    """(noise seed, response start, sampling params) of a coupled request, else None."""
    sp = getattr(req, "sampling_params", None)
    extra = getattr(sp, "extra_args", None)
    if not extra or extra.get(COUPLED_KEY) is None:
        return None
    from megatron_specrl.rollout.coupled import _i64
    # a 64-bit seed as the int64 the noise hashes (a seed >= 2**63 overflowed np.int64 in the step)
    return _i64(int(extra[COUPLED_KEY])), int(extra.get(RESPONSE_START, len(req.prompt_token_ids or ()))), sp


def _coupled_requests(runner) -> tuple[np.ndarray, np.ndarray, np.ndarray, list] | None:
    """(batch rows, noise seeds, response starts, sampling params) of the coupled requests running
    this step, or None. A request's setting is read once (cached by request id, as the tree drafter
    caches its keys): this runs every decode step for every running request."""
    batch = runner.input_batch
    cache = runner.__dict__.setdefault("_specrl_coupled_settings", {})
    if len(cache) > 2 * len(runner.requests) + 256:     # forget finished requests
        for req_id in [r for r in cache if r not in runner.requests]:
            del cache[req_id]
    rows, seeds, starts, params = [], [], [], []
    for i, req_id in enumerate(batch.req_ids[:batch.num_reqs]):
        setting = cache.get(req_id, _NOT_READ)
        if setting is _NOT_READ:
            setting = cache[req_id] = _coupled_setting(runner.requests.get(req_id))
        if setting is not None:
            rows.append(i)
            seeds.append(setting[0])
            starts.append(setting[1])
            params.append(setting[2])
    if not rows:
        return None
    return np.asarray(rows, np.int64), np.asarray(seeds, np.int64), np.asarray(starts, np.int64), params


def _processed(raw: torch.Tensor, params: list, repeats: np.ndarray) -> torch.Tensor:
    """Processed log-probs of `raw` rows; row block j uses params[j], repeated repeats[j] times."""
    vocab = raw.shape[-1]
    rep = lambda f, dt: torch.from_numpy(np.repeat(np.asarray([f(sp) for sp in params]), repeats).astype(dt)).to(raw.device)  # noqa: E731
    temperature = rep(lambda sp: sp.temperature, np.float32)
    top_k = rep(lambda sp: sp.top_k if 0 < sp.top_k < vocab else vocab, np.int32)
    top_p = rep(lambda sp: sp.top_p, np.float32)
    return tempered_and_processed(raw, temperature, top_k, top_p)[1]


def _rewrite_logprobs(logprobs_tensors, rows: torch.Tensor, processed: torch.Tensor, tokens: torch.Tensor) -> None:
    """The returned log-probs of `rows` recomputed for the coupled tokens (vLLM gathered them for
    the tokens its own sampler drew)."""
    from vllm.v1.sample.sampler import Sampler

    if logprobs_tensors is None or rows.numel() == 0:
        return
    k = logprobs_tensors.logprob_token_ids.shape[1] - 1
    new = Sampler.gather_logprobs(processed, k, tokens.to(torch.int64))
    logprobs_tensors.logprob_token_ids[rows] = new.logprob_token_ids.to(logprobs_tensors.logprob_token_ids.dtype)
    logprobs_tensors.logprobs[rows] = new.logprobs.to(logprobs_tensors.logprobs.dtype)
    logprobs_tensors.selected_token_ranks[rows] = new.selected_token_ranks.to(
        logprobs_tensors.selected_token_ranks.dtype)


def _sample(self, logits, spec_decode_metadata):
    original = _PATCH.original("_sample")
    coupled = None if logits is None else _coupled_requests(self)
    if coupled is None:
        return original(self, logits, spec_decode_metadata)
    from megatron_specrl.rollout.coupled import coupled_tokens

    rows, seeds, starts, params = coupled
    n = self.input_batch.num_reqs
    # the index in the sequence of the token sampled last in this step (the bonus token with drafts)
    seq_lens = (self.input_batch.num_computed_tokens_cpu[:n] + self.num_scheduled_tokens.np[:n]).astype(np.int64)
    device = logits.device

    if spec_decode_metadata is None:
        idx = torch.from_numpy(rows).to(device)
        raw = logits.index_select(0, idx).to(torch.float32, copy=True)   # the sampler edits logits in place
        out = original(self, logits, spec_decode_metadata)
        processed = _processed(raw, params, np.ones(len(rows), np.int64))
        tokens = coupled_tokens(processed, torch.from_numpy(seeds), torch.from_numpy(seq_lens[rows] - starts))
        out.sampled_token_ids[idx, 0] = tokens.to(out.sampled_token_ids.dtype)
        _rewrite_logprobs(out.logprobs_tensors, idx, processed, tokens)
        return out

    # speculative decoding: k_i drafts, then k_i + 1 positions (drafts + bonus) per coupled request
    meta = spec_decode_metadata
    k = np.asarray(meta.num_draft_tokens, np.int64)[rows]
    cu = np.asarray(meta.cu_num_draft_tokens.cpu(), np.int64)
    target_idx = meta.target_logits_indices.cpu().numpy()
    bonus_idx = meta.bonus_logits_indices.cpu().numpy()
    draft_ids = meta.draft_token_ids.cpu().numpy()
    logit_rows, positions, drafts = [], [], []
    for r, ki in zip(rows, k):
        first = cu[r] - ki
        logit_rows.append(np.append(target_idx[first:cu[r]], bonus_idx[r]))
        # draft j (0-based) is the token at sequence index seq_len - k + j; the bonus at seq_len
        positions.append(seq_lens[r] - ki + np.arange(ki + 1))
        drafts.append(draft_ids[first:cu[r]])
    logit_rows = torch.from_numpy(np.concatenate(logit_rows)).to(device)
    raw = logits.index_select(0, logit_rows).to(torch.float32, copy=True)
    out = original(self, logits, spec_decode_metadata)
    processed = _processed(raw, params, k + 1)
    tokens = coupled_tokens(processed, torch.from_numpy(np.repeat(seeds, k + 1)),
                            torch.from_numpy(np.concatenate(positions) - np.repeat(starts, k + 1))).cpu().numpy()
    width = out.sampled_token_ids.shape[1]
    new_rows = np.full((len(rows), width), -1, dtype=np.int64)   # -1: vLLM's placeholder, no token
    keep, offset = [], 0
    for j, ki in enumerate(k):
        c = tokens[offset:offset + ki + 1]
        mismatch = np.nonzero(drafts[j] != c[:ki])[0]
        m = int(mismatch[0]) + 1 if len(mismatch) else int(ki) + 1   # tokens emitted: through the first mismatch
        new_rows[j, :m] = c[:m]
        keep.append(offset + np.arange(m))
        offset += ki + 1
    idx = torch.from_numpy(rows).to(device)
    out.sampled_token_ids[idx] = torch.from_numpy(new_rows).to(out.sampled_token_ids.dtype).to(device)
    if out.logprobs_tensors is not None:
        # flattened [request * width + position] rows (RejectionSampler._get_logprobs_tensors)
        keep_src = np.concatenate(keep)
        keep_dst = np.concatenate([r * width + np.arange(len(kp)) for r, kp in zip(rows, keep)])
        src = torch.from_numpy(keep_src).to(device)
        _rewrite_logprobs(out.logprobs_tensors, torch.from_numpy(keep_dst).to(device),
                          processed.index_select(0, src), torch.from_numpy(tokens[keep_src]).to(device))
    return out


def _runner():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    return GPUModelRunner


_PATCH = PinnedPatch(VERSION, _runner, ["_sample"], lambda o: {"_sample": _sample})
apply, revert, is_applied = _PATCH.apply, _PATCH.revert, _PATCH.is_applied
