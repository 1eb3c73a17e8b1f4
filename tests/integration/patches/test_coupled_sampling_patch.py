"""Statistical check: `exact` speculative rollouts are samples of the new policy; `lenient` is not.

The tests of this subject that start processes or engines; the rest are in tests/unit/rollout/test_exactness.py.
"""

from __future__ import annotations
import numpy as np
import torch
from megatron_specrl.rollout import coupled
from types import SimpleNamespace


BIG = 2**63 + 12345     # a valid 64-bit seed; as the uint64 reference reads it


SMALL = 7


def _fake_runner(settings: dict[str, tuple[int, int, list[int]]]):
    from vllm import SamplingParams

    from megatron_specrl.patches.vllm_0_32_0_coupled_sampling import COUPLED_KEY, RESPONSE_START
    reqs = {rid: SimpleNamespace(prompt_token_ids=prompt,
                                 sampling_params=SamplingParams(temperature=1.0,
                                                                extra_args={COUPLED_KEY: seed, RESPONSE_START: start}))
            for rid, (seed, start, prompt) in settings.items()}
    return SimpleNamespace(input_batch=SimpleNamespace(req_ids=list(settings), num_reqs=len(settings)), requests=reqs)


def test_decode_patch_reads_a_64_bit_seed():
    from megatron_specrl.patches.vllm_0_32_0_coupled_sampling import _coupled_requests
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

    from megatron_specrl.patches import vllm_0_32_0_batched_prompt_logprobs as bp
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


