"""CUDA-only: the CUDA RNG state round trip of a learner checkpoint. Its CPU counterpart (fake CUDA
generators) is in tests/integration/learner/test_verl_parity.py.
"""

from __future__ import annotations
import pytest
import torch



def _bare_worker():
    from megatron_specrl.config import LearnerConfig
    from megatron_specrl.learner.worker import LearnerWorker
    w = object.__new__(LearnerWorker)
    w.settings, w.pp_rank, w.tp_rank, w.dp_rank = LearnerConfig(), 0, 0, 0
    return w


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rng_round_trip_gpu():
    from megatron_specrl.learner.worker import cuda_rng_states, restore_cuda_rng_states
    saved = cuda_rng_states()
    assert len(saved) == torch.cuda.device_count()
    first = torch.rand(16, device="cuda")
    torch.rand(1000, device="cuda")
    assert restore_cuda_rng_states(saved) == torch.cuda.device_count()
    assert torch.equal(torch.rand(16, device="cuda"), first)
    state = _bare_worker()._with_rng({})["rng"].data
    assert len(state["cuda"]) == torch.cuda.device_count()


