"""Review of coupled rollouts (rollout.spec_mode=coupled): the noise and the engine patches' seed handling.

- The position-keyed uniforms must lie strictly inside (0, 1): a uniform of exactly 1.0 is a Gumbel
  noise of +inf, which added to a -inf log-prob (a token outside the top-k / top-p nucleus) gives
  NaN, and argmax then returns that token: a draw outside the nucleus, with log-prob -inf.
- A noise seed is a 64-bit value (the uint64 reference masks it): the decode patch and the
  verification patch must read a seed >= 2**63 as the same 64-bit key, not crash the engine step
  (decode) or round the seeds of a whole verification batch through float64 (verification).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_specrl.rollout import coupled

_MASK = (1 << 64) - 1


def _unxorshift(y: int, s: int) -> int:
    x = y
    for _ in range(64 // s + 1):
        x = y ^ (x >> s)
    return x & _MASK


def _unmix(z: int) -> int:
    """Inverse of SplitMix64's finaliser (coupled._mix) on Python ints."""
    z = _unxorshift(z, 31)
    z = (z * pow(coupled._M2, -1, 1 << 64)) & _MASK
    z = _unxorshift(z, 27)
    z = (z * pow(coupled._M1, -1, 1 << 64)) & _MASK
    return _unxorshift(z, 30)


def _seed_whose_first_uniform_is_the_largest() -> int:
    """A noise seed whose hash at response position 0, token 0 has all 53 top bits set (a 2**-53
    event per cell: about once in 10**14 (position, token) cells, e.g. a 150k vocabulary x 10**9
    tokens of a long run)."""
    key = (_unmix(_MASK) - coupled._VOCAB_STEP) & _MASK               # column 0: key + 1 * VOCAB_STEP
    mixed_seed = (_unmix(key) - coupled._GOLDEN) & _MASK               # position 0: + 1 * GOLDEN
    return coupled._i64(_unmix(mixed_seed))


def test_uniforms_stay_below_one():
    seed = _seed_whose_first_uniform_is_the_largest()
    u = coupled.uniforms(torch.tensor([seed]), torch.tensor([0]), 4)
    assert float(u[0, 0]) < 1.0 and math.isfinite(float(coupled.gumbel(torch.tensor([seed]), torch.tensor([0]), 4)[0, 0]))
    assert coupled.uniforms_np(seed, 0, 4)[0] < 1.0
    # the numpy reference and torch still agree bit for bit
    assert np.array_equal(u[0].numpy(), coupled.uniforms_np(seed, 0, 4))


def test_a_token_outside_the_nucleus_is_never_drawn():
    seed = _seed_whose_first_uniform_is_the_largest()
    lp = torch.log_softmax(torch.tensor([[0.0, 2.0, 1.0, 0.5]]), -1)
    lp[0, 0] = -math.inf                       # token 0: cut by top-k / top-p
    tok = coupled.coupled_tokens(lp, torch.tensor([seed]), torch.tensor([0]))
    assert int(tok[0]) != 0


# -- seeds >= 2**63 in the engine patches -------------------------------------------------------

BIG = 2**63 + 12345     # a valid 64-bit seed; as the uint64 reference reads it
SMALL = 7


def _fake_runner(settings: dict[str, tuple[int, int, list[int]]]):
    from vllm import SamplingParams

    from patches.vllm_0_32_0_coupled_sampling import COUPLED_KEY, RESPONSE_START
    reqs = {rid: SimpleNamespace(prompt_token_ids=prompt,
                                 sampling_params=SamplingParams(temperature=1.0,
                                                                extra_args={COUPLED_KEY: seed, RESPONSE_START: start}))
            for rid, (seed, start, prompt) in settings.items()}
    return SimpleNamespace(input_batch=SimpleNamespace(req_ids=list(settings), num_reqs=len(settings)), requests=reqs)


def test_decode_patch_reads_a_64_bit_seed():
    from patches.vllm_0_32_0_coupled_sampling import _coupled_requests
    rows, seeds, starts, _ = _coupled_requests(_fake_runner({"a": (BIG, 3, [1, 2, 3]), "b": (SMALL, 2, [1, 2])}))
    assert rows.tolist() == [0, 1] and starts.tolist() == [3, 2]
    # the same noise as the uint64 reference for that seed
    u = coupled.uniforms(torch.from_numpy(seeds), torch.tensor([5, 5]), 16)
    assert np.array_equal(u[0].numpy(), coupled.uniforms_np(BIG, 5, 16))
    assert np.array_equal(u[1].numpy(), coupled.uniforms_np(SMALL, 5, 16))


def test_verification_patch_keeps_every_seed_of_a_batch():
    """Two coupled verification requests in one batch, one seed >= 2**63: every row's coupled draw
    is the draw with its own seed at its own response position."""
    from vllm import SamplingParams
    from vllm.v1.outputs import LogprobsTensors

    from patches import vllm_0_32_0_batched_prompt_logprobs as bp
    vocab, n = 64, 40
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2 * n, vocab, generator=g)
    runner = SimpleNamespace(model=SimpleNamespace(compute_logits=lambda h: h),
                             model_config=SimpleNamespace(get_vocab_size=lambda: vocab))
    group, start = [], 5
    for i, seed in enumerate((BIG, SMALL)):
        sp = SamplingParams(temperature=1.0, prompt_logprobs=3, extra_args={
            bp.VERIFY_KEY: start, bp.COUPLED_KEY: seed, bp.SEED_KEY: 1})
        verify, first = bp._verify_settings(SimpleNamespace(sampling_params=sp), vocab)
        dest = LogprobsTensors.empty_cpu(n, bp.VERIFY_COLUMNS)
        targets = torch.randint(0, vocab, (n,), generator=g).numpy()
        group.append(bp._Rows(3, i * n, n, targets, dest, slice(0, n), verify, first))
    bp._verify_group(runner, logits, group)
    for i, (w, seed) in enumerate(zip(group, (BIG, SMALL))):
        lp = torch.log_softmax(logits[i * n:(i + 1) * n], -1)
        expected = coupled.coupled_tokens(lp, torch.full((n,), coupled._i64(seed)), torch.arange(n))
        assert w.dest.logprob_token_ids[:, 2].tolist() == expected.tolist(), f"request {i} (seed {seed})"


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
