"""Coupled sampling: every (prompt, sample) draws its token at response position t with noise that is
a fixed function of (noise seed, t), so consecutive epochs reuse most of each other's tokens while
each response stays an exact sample of the policy that produced it.

A token is drawn by the Gumbel-max trick on the distribution the sampler uses (`processed`:
logits / T, then top-k / top-p, renormalised):

    y_t = argmax_v  processed_logprob(v | y_<t) + G(seed, t, v),   G = -log(-log U),  U ~ U(0, 1)

which is vLLM's own rule (`probs / Exp(1)`, argmax) written in logs. U is a counter-based hash
(SplitMix64) of (seed, t, v): no generator state, so the noise at position t is the same whether t
is reached by decoding from the prompt, by an extension that starts at t, by a draft verified in a
prefill, or in any batch. Under fixed weights the noise is i.i.d. across positions and vocabulary,
so y is an exact sample; after a weight update the response under the same noise changes only
where the argmax changes, and everything before the first change is the old response.
Caveat: that holds for weights chosen independently of the noise. In RL the weights were trained on
what this noise drew earlier, so reused noise is not a fresh sample of the trained policy (the
README measures held-out accuracy falling); `exact` draws fresh randomness every step.

Pure torch (no engine import): the vLLM patches call `coupled_tokens` in the decode sampler, in the
rejection step of speculative decoding, and in the verification prefill, so all three draw
identically. `splitmix64_np` is the numpy reference the tests compare against.
"""

from __future__ import annotations

import numpy as np
import torch

_MASK64 = (1 << 64) - 1


def _i64(c: int) -> int:
    """An unsigned 64-bit constant as the signed int64 torch stores."""
    c &= _MASK64
    return c - (1 << 64) if c >> 63 else c


_GOLDEN = 0x9E3779B97F4A7C15
_VOCAB_STEP = 0xD1B54A32D192ED03      # a second odd constant: rows and columns do not collide
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


_U_MAX = 1.0 - 2.0 ** -53               # the largest float64 below 1


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors (wrapping multiplication, as uint64 would)."""
    z = z ^ _shr(z, 30)
    z = z * _i64(_M1)
    z = z ^ _shr(z, 27)
    z = z * _i64(_M2)
    return z ^ _shr(z, 31)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One 64-bit key per (seed, response position), int64 tensors of equal shape."""
    return _mix(_mix(seeds.to(torch.int64)) + (positions.to(torch.int64) + 1) * _i64(_GOLDEN))


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, vocab] float64 uniforms in (0, 1): U(seed_r, position_r, v)."""
    keys = row_keys(seeds, positions)
    out = torch.empty((keys.shape[0], vocab), dtype=torch.float64, device=keys.device)
    z = torch.empty((keys.shape[0], vocab), dtype=torch.int64, device=keys.device)
    _uniforms_into(out, z, torch.empty_like(z), keys, _columns(vocab, keys.device))
    return out


def gumbel(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, vocab] float64 Gumbel(0, 1) noise G = -log(-log U)."""
    return uniforms(seeds, positions, vocab).log_().neg_().log_().neg_()


def _columns(vocab: int, device) -> torch.Tensor:
    return (torch.arange(vocab, dtype=torch.int64, device=device) + 1) * _i64(_VOCAB_STEP)


def _uniforms_into(out: torch.Tensor, z: torch.Tensor, tmp: torch.Tensor, keys: torch.Tensor,
                   cols: torch.Tensor) -> None:
    """`uniforms` written into `out` (float64) with int64 scratch `z` and `tmp` of its shape: the
    same operations as `_mix`, in place (a fresh tensor per operation made the noise cost ~20x a
    log-softmax of the same rows)."""
    torch.add(keys.unsqueeze(1), cols.unsqueeze(0), out=z)
    for shift, mult in ((30, _M1), (27, _M2), (31, None)):
        torch.bitwise_right_shift(z, shift, out=tmp)
        tmp.bitwise_and_((1 << (64 - shift)) - 1)        # logical shift: clear the sign copies
        z.bitwise_xor_(tmp)
        if mult is not None:
            z.mul_(_i64(mult))
    torch.bitwise_right_shift(z, 11, out=tmp)
    tmp.bitwise_and_((1 << 53) - 1)
    # top 53 bits, centred in their interval: never exactly 0; the top one, 2**53 - 0.5, rounds to
    # 2**53 (ties to even), so it is clamped below 1 (a uniform of 1 is a Gumbel of +inf: NaN and
    # argmax on a token outside the nucleus)
    out.copy_(tmp).add_(0.5).mul_(1.0 / (1 << 53)).clamp_(max=_U_MAX)


# rows per block in `coupled_tokens`: about this many (row, token) cells. On a CPU the scratch then
# stays in cache; on a GPU a block is a few kernels over 16M cells (3 x 128 MiB scratch), not
# thousands of small launches (a decode step of 256 requests x 152k vocabulary is 3 blocks).
_CELLS_PER_BLOCK = 1 << 16
_CELLS_PER_BLOCK_GPU = 1 << 24


def coupled_tokens(processed_logprobs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The coupled draw per row: argmax_v processed_logprobs[r, v] + G(seed_r, position_r, v).
    Tokens outside the nucleus (-inf) are never drawn. int64 [R]. Computed in blocks of rows with
    reused scratch buffers; the values are those of `gumbel`, bit for bit."""
    rows, vocab = processed_logprobs.shape
    device = processed_logprobs.device
    out = torch.empty(rows, dtype=torch.int64, device=device)
    if rows == 0:
        return out
    keys = row_keys(seeds.to(device), positions.to(device))
    cols = _columns(vocab, device)
    cells = _CELLS_PER_BLOCK if device.type == "cpu" else _CELLS_PER_BLOCK_GPU
    block = max(1, min(rows, cells // max(vocab, 1)))
    score = torch.empty((block, vocab), dtype=torch.float64, device=device)
    z, tmp = torch.empty((block, vocab), dtype=torch.int64, device=device), torch.empty((block, vocab), dtype=torch.int64, device=device)
    for lo in range(0, rows, block):
        hi = min(lo + block, rows)
        n = hi - lo
        _uniforms_into(score[:n], z[:n], tmp[:n], keys[lo:hi], cols)
        g = score[:n].log_().neg_().log_().neg_()          # Gumbel noise
        g.add_(processed_logprobs[lo:hi])                   # float64 += the row's log-probs
        torch.argmax(g, dim=-1, out=out[lo:hi])
    return out


# -- numpy reference (tests) ---------------------------------------------------------------------

def splitmix64_np(z: np.ndarray) -> np.ndarray:
    z = np.asarray(z, dtype=np.uint64).copy()
    with np.errstate(over="ignore"):
        z ^= z >> np.uint64(30)
        z *= np.uint64(_M1)
        z ^= z >> np.uint64(27)
        z *= np.uint64(_M2)
        z ^= z >> np.uint64(31)
    return z


def uniforms_np(seed: int, position: int, vocab: int) -> np.ndarray:
    """The same uniforms as `uniforms` for one row, computed in uint64 numpy."""
    with np.errstate(over="ignore"):
        key = splitmix64_np(splitmix64_np(np.uint64(seed & _MASK64)) + np.uint64(position + 1) * np.uint64(_GOLDEN))
        z = splitmix64_np(key + (np.arange(vocab, dtype=np.uint64) + np.uint64(1)) * np.uint64(_VOCAB_STEP))
    return np.minimum(((z >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53)), _U_MAX)
