"""The batched prompt-log-prob patch's chunk budget and chunk loop. No vLLM engine is
started: the patch's group functions (`_verify_group`, `_score_group`) run on a stand-in runner whose
hidden states are the logits (a matmul's last bits depend on the row count, the patch's math must not).

1. The budget was 512 MiB everywhere: at a 152k vocabulary ~73 verification rows a chunk, ~220
   chunks one after another for a 16k-token prefill on a GPU. `chunk_rows` keeps 512 MiB on CPU and
   sizes CUDA chunks from the free device memory, between 512 MiB and 4 GiB.
2. Each chunk read back from the device whether any row uses top-k / top-p and whether all rows
   are coupled (host syncs). The group's settings are on the host: the chunk loop now reads those.
3. Results do not depend on the chunking (bit for bit), chunks of one row to one chunk for all.

`verify_columns` reads a verification request's columns from either container vLLM hands over
(the patch's VerifyColumns arrays, or vLLM's FlatLogprobs when the output-side patch is reverted)
through one path, and refuses columns that do not hold the draft: that is what a worker without
the batched prompt-log-prob patch returns (vLLM's own top-k prompt log-probs).
"""

import os
from types import SimpleNamespace
import numpy as np
import pytest
import torch
from vllm.logprobs import FlatLogprobs
from megatron_specrl.engines.vllm import verify_columns
from megatron_specrl.patches.vllm_0_32_0_batched_prompt_logprobs import UNCOMPUTED, VERIFY_COLUMNS, VerifyColumns



# ---- The batched prompt-log-prob patch's chunk budget and chunk loop. No vLLM engine is

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import megatron_specrl.patches.vllm_0_32_0_batched_prompt_logprobs as P  # noqa: E402

QWEN_VOCAB = 151936
GIB = 1 << 30


# -- 1. the budget -------------------------------------------------------------------------------

def test_cpu_keeps_the_512_mib_budget():
    old = (512 << 20) // (4 * P._VERIFY_BUFFERS * QWEN_VOCAB)
    assert old == 73
    assert P.chunk_rows("cpu", None, QWEN_VOCAB, P._VERIFY_BUFFERS) == old
    assert P.chunk_rows("cpu", 40 * GIB, QWEN_VOCAB, P._VERIFY_BUFFERS) == old   # free memory: CUDA only
    assert P.chunk_rows("cpu", None, QWEN_VOCAB, 1) == (512 << 20) // (4 * QWEN_VOCAB)
    assert P.chunk_rows("cpu", None, 10**12, P._VERIFY_BUFFERS) == 1             # never 0 rows


def test_cuda_sizes_chunks_from_free_memory_between_floor_and_cap():
    cpu = P.chunk_rows("cpu", None, QWEN_VOCAB, P._VERIFY_BUFFERS)
    row = 4 * P._VERIFY_BUFFERS * QWEN_VOCAB
    big = P.chunk_rows("cuda", 40 * GIB, QWEN_VOCAB, P._VERIFY_BUFFERS)
    assert big == (4 * GIB) // row == 588 and big >= 8 * cpu            # capped at 4 GiB
    assert P.chunk_rows("cuda", 400 * GIB, QWEN_VOCAB, P._VERIFY_BUFFERS) == big
    mid = P.chunk_rows("cuda", 8 * GIB, QWEN_VOCAB, P._VERIFY_BUFFERS)
    assert mid == int(8 * GIB * P._FREE_FRACTION) // row and cpu < mid < big
    assert P.chunk_rows("cuda", 1 * GIB, QWEN_VOCAB, P._VERIFY_BUFFERS) == cpu   # the floor
    assert P.chunk_rows("cuda", 0, QWEN_VOCAB, P._VERIFY_BUFFERS) == cpu
    assert P.chunk_rows("cuda", None, QWEN_VOCAB, P._VERIFY_BUFFERS) == cpu
    # a 16k-token verification prefill: ~28 chunks instead of ~225
    assert -(-16384 // big) <= 28 < 225 <= -(-16384 // cpu)


def test_free_device_bytes_is_cuda_only():
    assert P._free_device_bytes(torch.device("cpu")) is None


# -- the stand-in runner and a verification group ------------------------------------------------















# -- 2/3. the chunk loop -------------------------------------------------------------------------











# ---- `verify_columns` reads a verification request's columns from either container vLLM hands over

PROMPT_LEN = 3
DRAFT = [11, 12, 13, 14]
EOS = frozenset({2})


def _rows(draft, replacements):
    """Columns of prompt positions 1.. (the first prompt token has none): prompt rows, then the draft's."""
    rng = np.random.default_rng(0)
    ids = [[7, 7, 8, 8]] * (PROMPT_LEN - 1) + [[y, y, r, r] for y, r in zip(draft, replacements)]
    lps = -rng.random((len(ids), VERIFY_COLUMNS)).astype(np.float32)
    return np.asarray(ids, dtype=np.int64), lps


def _containers(ids, lps):
    arrays = VerifyColumns()
    arrays.add(torch.from_numpy(ids[:2]), torch.from_numpy(lps[:2]))    # arrives in two chunks
    arrays.add(torch.from_numpy(ids[2:]), torch.from_numpy(lps[2:]))
    flat = FlatLogprobs()
    flat.append(None)                                                    # prompt token 0
    for row_ids, row_lps in zip(ids.tolist(), lps.tolist()):
        flat.append_fast(row_ids, row_lps, iter([1] * VERIFY_COLUMNS), [None] * VERIFY_COLUMNS)
    return arrays, flat


def test_both_containers_give_the_same_result():
    ids, lps = _rows(DRAFT, [11, 2, 30, 14])          # r == y: no replacement; 2 is an EOS
    results = [verify_columns(c, PROMPT_LEN, DRAFT, EOS, 5) for c in _containers(ids, lps)]
    assert results[0] == results[1]
    res = results[0]
    assert res.replacements == [-1, 2, 30, -1] and res.replacement_stops == [False, True, False, False]
    assert res.sample_logprobs == lps[PROMPT_LEN - 1:, 1].astype(np.float64).tolist()
    coupled = verify_columns(_containers(ids, lps)[0], PROMPT_LEN, DRAFT, EOS, 5, coupled=True)
    assert coupled.replacements == [11, 2, 30, 14]     # coupled: r is the draw, r == y means kept


@pytest.mark.parametrize("container", [0, 1], ids=["VerifyColumns", "FlatLogprobs"])
def test_columns_without_the_draft_token_are_refused(container):
    ids, lps = _rows([11, 12, 99, 14], [11, 12, 99, 14])   # position 2 scores another token
    with pytest.raises(RuntimeError, match=r"position 5 do not hold the draft token 13.*patch"):
        verify_columns(_containers(ids, lps)[container], PROMPT_LEN, DRAFT, EOS, 0)


def test_unpatched_flat_columns_are_refused():
    """An unpatched worker returns 1 + prompt_logprobs columns only where y is outside the top
    ones: widths vary, so the rows end early and the error names the first such position."""
    flat = FlatLogprobs()
    flat.append(None)
    for _ in range(PROMPT_LEN - 1):
        flat.append_fast([7, 7, 8, 8], [-1.0] * 4, iter([1] * 4), [None] * 4)
    flat.append_fast([11, 11, 8, 8], [-1.0] * 4, iter([1] * 4), [None] * 4)
    flat.append_fast([12, 8, 9], [-1.0] * 3, iter([1] * 3), [None] * 3)
    with pytest.raises(RuntimeError, match=r"position 4 do not hold the draft token 12 \(1 of 4 rows"):
        verify_columns(flat, PROMPT_LEN, DRAFT, EOS, 0)
    with pytest.raises(RuntimeError, match="flat_logprobs"):
        verify_columns([None, {7: -1.0}], PROMPT_LEN, DRAFT, EOS, 0)


def test_rows_the_engine_did_not_compute_are_refused():
    """Rows a prefix-cache hit skipped carry the patch's mark (y, y, -1, -1 with NaN log-probs):
    reading them as verified would hand NaN acceptance log-probs to the rollout. NaN from the model
    itself is not this error: the acceptance rules reject and count it (spec/nonfinite_logprobs)."""
    ids, lps = _rows(DRAFT, DRAFT)
    lps[PROMPT_LEN - 1 + 1, :] = np.nan                                 # the model's NaN: passed on
    assert np.isnan(verify_columns(_containers(ids, lps)[0], PROMPT_LEN, DRAFT, EOS, 0).sample_logprobs[1])
    ids[PROMPT_LEN - 1 + 2, 2:] = UNCOMPUTED
    lps[PROMPT_LEN - 1 + 2, :] = np.nan
    with pytest.raises(RuntimeError, match="position 5 were not computed"):
        verify_columns(_containers(ids, lps)[0], PROMPT_LEN, DRAFT, EOS, 0)


class _Coordinator:
    def find_longest_cache_hit(self, block_hashes, max_cache_hit_length):
        return max_cache_hit_length


class _Manager:
    """vLLM's lookup reduced to what the cap touches: it asks the coordinator for the longest hit
    up to num_tokens - 1."""

    def __init__(self):
        self.coordinator = _Coordinator()

    def get_computed_blocks(self, request):
        return self.coordinator.find_longest_cache_hit(None, request.num_tokens - 1)


def test_verification_cache_reads_stop_before_the_continuation():

    from megatron_specrl.patches.vllm_0_32_0_batched_prompt_logprobs import VERIFY_KEY, _make_cache_cap

    capped = _make_cache_cap({"get_computed_blocks": _Manager.get_computed_blocks})["get_computed_blocks"]
    manager = _Manager()

    def request(extra, skip=False):
        return SimpleNamespace(num_tokens=200, skip_reading_prefix_cache=skip,
                               sampling_params=SimpleNamespace(extra_args=extra))

    assert capped(manager, request({VERIFY_KEY: 70})) == 69      # the logits of position 69 score y_0
    assert capped(manager, request({VERIFY_KEY: True})) == 0
    assert capped(manager, request(None)) == 199                 # generation requests: vLLM's lookup
    assert capped(manager, request({VERIFY_KEY: 70}, skip=True)) == 199   # (vLLM skips the lookup itself)
    assert "find_longest_cache_hit" not in vars(manager.coordinator)       # the cap is per call
