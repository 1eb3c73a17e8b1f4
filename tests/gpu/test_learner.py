"""CUDA-only: the CUDA RNG state round trip of a learner checkpoint. Its CPU counterpart (fake CUDA
generators) is in tests/integration/learner/test_verl_parity.py.
"""

from __future__ import annotations
import pytest
import torch

from tests.helpers.learner import one_rank_state



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rng_round_trip_gpu():
    from megatron_specrl.learner.checkpoint_io import cuda_rng_states, restore_cuda_rng_states, with_rng
    saved = cuda_rng_states()
    assert len(saved) == torch.cuda.device_count()
    first = torch.rand(16, device="cuda")
    torch.rand(1000, device="cuda")
    assert restore_cuda_rng_states(saved) == torch.cuda.device_count()
    assert torch.equal(torch.rand(16, device="cuda"), first)
    state = with_rng(one_rank_state(), {})["rng"].data
    assert len(state["cuda"]) == torch.cuda.device_count()


