"""CPU shims for megatron-core: version gate, idempotence, and each shim's CPU behaviour."""

from __future__ import annotations

import pytest
import torch

import patches

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the shims are CPU-only")


def test_refuses_untested_version(monkeypatch):
    import megatron.core
    monkeypatch.setattr(megatron.core, "__version__", "0.99.0")
    with pytest.raises(patches.UnsupportedMegatronVersion, match="0.99.0.*0.16.1"):
        patches.apply()


def test_apply_is_idempotent_and_shims_work():
    assert patches.apply() is True
    assert patches.apply() is True
    from megatron.core.fusions import fused_softmax
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.utils import GlobalMemoryBuffer

    mask = fused_softmax.get_default_causal_mask(3)
    assert mask.device.type == "cpu" and mask.tolist() == [[False, True, True], [False, False, True], [False, False, False]]
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)
    assert rope.get_emb(5).shape == (5, 1, 1, 8)
    assert GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "x").device.type == "cpu"

    tracker = tp_random.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("model-parallel-rng", 1234)
    before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)  # default stream untouched
    tracker.reset()
    tracker.add("model-parallel-rng", 1234)
    with tracker.fork():
        b = torch.rand(3)
    assert torch.equal(a, b)


def test_cuda_to_cpu_is_scoped():
    from megatron.core.pipeline_parallel import p2p_communication, schedules
    patches.apply()
    with patches.cuda_to_cpu():
        z = schedules.torch.zeros([], dtype=torch.int, device="cuda")
        e = p2p_communication.torch.empty((2,), device=p2p_communication.torch.cuda.current_device())
        assert z.device.type == "cpu" and e.device.type == "cpu"
        assert schedules.torch.Tensor is torch.Tensor
    assert schedules.torch is torch and p2p_communication.torch is torch
