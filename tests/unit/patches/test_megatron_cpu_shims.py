"""CPU shims for megatron-core: version gate, idempotence, and each shim's CPU behaviour.
"""

from __future__ import annotations
import types
import pytest
import torch
from megatron_specrl import patches

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


def test_megatron_optimizer_shim_is_scoped():
    """Inside the context, Megatron's DDP / optimizer modules allocate on CPU, CPU tensors report CUDA
    type strings (conversions with an argument still convert) and .cuda() is the identity; everything
    is restored on exit. The distributed optimizer's loader is not the CPU shim's business (below)."""
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    patches.apply()
    t = torch.zeros(3)
    orig_set = DistributedOptimizer._set_main_param_and_optimizer_states
    with patches.megatron_optimizer_on_cpu():
        assert t.type() == "torch.cuda.FloatTensor" and t.bfloat16().type() == "torch.cuda.BFloat16Tensor"
        assert t.type(torch.float64).dtype == torch.float64 and t.type(torch.float64).device.type == "cpu"
        assert t.cuda() is t
        buf = param_and_grad_buffer.torch.zeros(4, device=param_and_grad_buffer.torch.cuda.current_device())
        norm = clip_grads.torch.tensor([1.0], device="cuda")
        assert buf.device.type == "cpu" and norm.device.type == "cpu"
        assert DistributedOptimizer._set_main_param_and_optimizer_states is orig_set
    assert t.type() == "torch.FloatTensor"
    assert distrib_optimizer.torch is torch and param_and_grad_buffer.torch is torch and clip_grads.torch is torch
    with pytest.raises((AssertionError, RuntimeError)):
        t.cuda()


def test_torch_adam_step_is_held_out_of_the_loader_copy_on_any_device(monkeypatch):
    """Loading a reshardable distributed-optimizer checkpoint into torch's Adam (no TE / apex) raised
    KeyError('step') on an H200: the fix lived in the CPU shim, which GPUs never enter. The loader's
    copy skips a "step" missing from the source and keeps the state's own, with CUDA reported present."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron_specrl.patches.megatron_core_0_16_1_torch_adam_load import torch_adam_step_held_out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)     # what a GPU learner sees
    main = torch.zeros(4)
    fake = types.SimpleNamespace(
        config=types.SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False),
        model_param_group_index_map={"p": (0, 0)},
        optimizer=types.SimpleNamespace(param_groups=[{"params": [main]}], state={}))
    step = torch.tensor(5.0)
    fake.optimizer.state[main] = {"exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4), "step": step}
    src = {"param": torch.ones(4), "exp_avg": torch.full((4,), 2.0), "exp_avg_sq": torch.full((4,), 3.0)}
    orig_set = DistributedOptimizer._set_main_param_and_optimizer_states
    with pytest.raises(KeyError, match="step"):   # the upstream behaviour the patch works around
        orig_set(fake, "p", src)
    with torch_adam_step_held_out():
        assert DistributedOptimizer._set_main_param_and_optimizer_states.__wrapped__ is orig_set
        DistributedOptimizer._set_main_param_and_optimizer_states(fake, "p", src)
    st = fake.optimizer.state[main]
    assert main.tolist() == [1.0] * 4 and st["exp_avg"].tolist() == [2.0] * 4 and st["exp_avg_sq"].tolist() == [3.0] * 4
    assert st["step"] is step
    assert DistributedOptimizer._set_main_param_and_optimizer_states is orig_set