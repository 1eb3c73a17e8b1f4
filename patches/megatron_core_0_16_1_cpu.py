"""CPU shims for megatron-core 0.16.1 (measured on torch 2.13 CPU, gloo).

Four places hard-code CUDA on the forward/backward path of GPTModel with the
local spec (a fifth with tied embeddings under PP), and the pipeline schedules allocate on "cuda". Each shim replaces
exactly that behaviour with its CPU equivalent; nothing else changes.
"""

from __future__ import annotations

import contextlib
import operator
import types
from functools import reduce

import torch

VERSION = "0.16.1"
_APPLIED = False


def _check_version():
    import megatron.core
    if megatron.core.__version__ != VERSION:
        from megatron_specrl.patches import UnsupportedMegatronVersion
        raise UnsupportedMegatronVersion(
            f"megatron_specrl.patches.megatron_core_0_16_1_cpu targets megatron-core {VERSION}, "
            f"found {megatron.core.__version__}")


# 1. RoPE: get_emb moves inv_freq to torch.cuda.current_device().
def _rope_get_emb(self, max_seq_len: int, offset: int = 0):
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    if not self.rotary_interleaved:
        emb = torch.cat((freqs, freqs), dim=-1)
    else:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    return emb[:, None, None, :]


# 2. GlobalMemoryBuffer.get_tensor allocates on the CUDA device.
def _buffer_get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
    required_len = reduce(operator.mul, tensor_shape, 1)
    buf = self.buffer.get((name, dtype))
    if buf is None or buf.numel() < required_len:
        self.buffer[(name, dtype)] = torch.empty(required_len, dtype=dtype, device="cpu",
                                                 requires_grad=False)
    return self.buffer[(name, dtype)][0:required_len].view(*tensor_shape)


# 3. Default causal / sliding-window masks use device="cuda".
def _default_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _sliding_window_causal_mask(sq, skv, window_size):
    m = torch.ones(sq, skv, dtype=torch.bool)
    mu = torch.triu(m, diagonal=skv - sq - window_size[0])
    return ~torch.tril(mu, diagonal=skv - sq + window_size[1])


# 4. The TP RNG tracker snapshots torch.cuda RNG states; track the CPU generator instead.
def _make_cpu_tracker(base):
    class CpuRNGStatesTracker(base):
        """Same contract as CudaRNGStatesTracker, over the CPU default generator."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name="model-parallel-rng"):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    return CpuRNGStatesTracker


# 5. Tied embeddings with PP > 1: setup_embeddings_and_output_layer calls weight.data.cuda()
#    before all-reducing the last stage's copy; on CPU that copy stays on the CPU.
def _wrap_setup_embeddings(orig):
    def setup_embeddings_and_output_layer(self):
        saved = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *a, **k: t
        try:
            return orig(self)
        finally:
            torch.Tensor.cuda = saved
    setup_embeddings_and_output_layer.__wrapped__ = orig
    return setup_embeddings_and_output_layer


class _NullStream:
    """The one CUDA stream a CPU has: waits and events are immediate."""

    def wait_stream(self, _other):
        return None

    def record_event(self, *_a, **_k):
        return self

    def synchronize(self):
        return None


class _MoeCpuCuda:
    """`torch.cuda` of the MoE router and token dispatcher: the router moves its weight to
    torch.cuda.current_device() on every forward, the alltoall dispatcher copies its token counts to
    the host on a side stream (torch.cuda.Stream, current_stream, stream(), record_event)."""

    _stream = _NullStream()

    @staticmethod
    def current_device():
        return torch.device("cpu")

    def Stream(self, *_a, **_k):   # noqa: N802 (torch.cuda's name)
        return self._stream

    def current_stream(self, *_a, **_k):
        return self._stream

    @staticmethod
    def stream(_s):
        return contextlib.nullcontext()

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


# + the tensor-parallel linears, whose sequence-parallel backward allocates on torch.cuda.current_device()
_MOE_MODULES = ("megatron.core.transformer.moe.router", "megatron.core.transformer.moe.token_dispatcher",
                "megatron.core.transformer.moe.experts", "megatron.core.tensor_parallel.layers")


def _moe_torch_proxy():
    proxy = types.ModuleType("torch_moe_cpu_proxy")
    proxy.__getattr__ = lambda name: getattr(torch, name)  # PEP 562 module __getattr__
    proxy.cuda = _MoeCpuCuda()
    return proxy


def _host_copy(tensor, as_numpy: bool = False, record_stream: bool = False):
    """moe_utils.maybe_move_tensor_to_cpu for tensors already on the host: its `as_numpy` converts only
    CUDA tensors, so on a CPU the alltoall split sizes stayed tensors, which all_to_all_single refuses."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _wrap_uneven_gather(orig):
    """gloo's all_gather takes equal sizes only; the MoE dispatcher gathers a TP group's tokens with
    uneven `output_split_sizes`. Pad each rank's rows to the largest, gather, cut the padding off."""
    import torch.distributed as dist

    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or len(set(output_split_sizes)) <= 1 or group.size() == 1:
            return orig(input_, group, output_split_sizes, use_global_buffer)
        most = max(output_split_sizes)
        pad = input_.new_zeros(most, *input_.shape[1:])
        pad[: input_.shape[0]] = input_
        parts = [torch.empty_like(pad) for _ in range(group.size())]
        dist.all_gather(parts, pad.contiguous(), group=group)
        return torch.cat([t[:n] for t, n in zip(parts, output_split_sizes)], dim=0)
    gather.__wrapped__ = orig
    return gather


def _wrap_uneven_reduce_scatter(orig):
    """The reverse of the uneven gather: gloo's reduce_scatter takes equal sizes only, so sum the
    whole tensor over the group and keep this rank's rows."""
    import torch.distributed as dist

    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or len(set(input_split_sizes)) <= 1 or group.size() == 1:
            return orig(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        start = sum(input_split_sizes[: group.rank()])
        return total[start: start + input_split_sizes[group.rank()]].clone()
    reduce_scatter.__wrapped__ = orig
    return reduce_scatter


def _wrap_torch_norm_new(orig):
    """WrappedTorchNorm (the local spec's norm without apex) refuses sequence parallelism only because
    it never marks its weight for the TP gradient sum; apex's and TE's norms set
    `weight.sequence_parallel`, which finalize_model_grads reads. Build it as without, then mark it."""
    import copy

    def __new__(cls, config, *args, **kwargs):
        if not config.sequence_parallel:
            return orig(cls, config, *args, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = orig(cls, plain, *args, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm
    __new__.__wrapped__ = orig
    return __new__


def apply() -> bool:
    """Install the shims once (idempotent)."""
    global _APPLIED
    if _APPLIED:
        return True
    _check_version()
    from megatron.core import utils as mc_utils
    from megatron.core.fusions import fused_softmax
    from megatron.core.models.common.language_module import language_module
    from megatron.core.models.common.embeddings import rotary_pos_embedding
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer import utils as tr_utils

    rotary_pos_embedding.RotaryEmbedding.get_emb = _rope_get_emb
    mc_utils.GlobalMemoryBuffer.get_tensor = _buffer_get_tensor
    for mod in (tr_utils, fused_softmax):
        mod.get_default_causal_mask = _default_causal_mask
        mod.get_sliding_window_causal_mask = _sliding_window_causal_mask
    lm = language_module.LanguageModule
    lm.setup_embeddings_and_output_layer = _wrap_setup_embeddings(lm.setup_embeddings_and_output_layer)
    tp_random.CudaRNGStatesTracker = _make_cpu_tracker(tp_random.CudaRNGStatesTracker)
    # model_parallel_cuda_manual_seed seeds torch.cuda (a lazy no-op without CUDA) and the tracker.
    tp_random.initialize_rng_tracker(force_reset=True)
    # 7. MoE layers (router, alltoall token dispatcher, experts): their `torch.cuda` is a CPU stand-in.
    import importlib
    for name in _MOE_MODULES:
        importlib.import_module(name).torch = _moe_torch_proxy()
    from megatron.core.transformer.moe import token_dispatcher
    token_dispatcher.maybe_move_tensor_to_cpu = _host_copy
    from megatron.core.tensor_parallel import mappings
    mappings._gather_along_first_dim = _wrap_uneven_gather(mappings._gather_along_first_dim)
    mappings._reduce_scatter_along_first_dim = _wrap_uneven_reduce_scatter(mappings._reduce_scatter_along_first_dim)
    # 8. Sequence parallelism (MoE with TP needs it) through the torch norms.
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    WrappedTorchNorm.__new__ = staticmethod(_wrap_torch_norm_new(WrappedTorchNorm.__new__))
    # The fp32 router GEMM tests `te_general_gemm is not None`, a name moe_utils binds only when
    # TransformerEngine imports: without TE it is unbound (NameError), None is the meant value.
    from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    _APPLIED = True
    return True


def is_applied() -> bool:
    return _APPLIED


class _CpuCuda:
    """Stands in for `torch.cuda` inside the schedules: the current device is the CPU."""

    @staticmethod
    def current_device():
        return torch.device("cpu")

    @staticmethod
    def synchronize(*_a, **_k):
        return None

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


def _to_cpu(device):
    if device is None:
        return None
    if isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda":
        return torch.device("cpu")
    if isinstance(device, int):
        return torch.device("cpu")
    return device


def _make_torch_proxy():
    proxy = types.ModuleType("torch_cpu_proxy")

    def _wrap(fn):
        def inner(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _to_cpu(kwargs["device"])
            return fn(*args, **kwargs)
        return inner

    proxy.__getattr__ = lambda name: getattr(torch, name)  # PEP 562 module __getattr__
    for name in ("zeros", "empty", "ones", "tensor", "full", "empty_like", "zeros_like"):
        setattr(proxy, name, _wrap(getattr(torch, name)))
    proxy.cuda = _CpuCuda()
    return proxy


_SCHEDULE_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.tensor_parallel.mappings",
    # dist checkpointing (sync writer): preload does torch.cuda.synchronize(), the saver
    # all-reduces flags allocated on "cuda".
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.exchange_utils",
)


@contextlib.contextmanager
def cuda_to_cpu(modules=_SCHEDULE_MODULES):
    """Scoped rewrite of `device="cuda"` to CPU in the schedule/p2p/checkpoint modules (restored on exit)."""
    import importlib
    proxy = _make_torch_proxy()
    saved = []
    for name in modules:
        mod = importlib.import_module(name)
        saved.append((mod, mod.torch))
        mod.torch = proxy
    try:
        yield
    finally:
        for mod, orig in saved:
            mod.torch = orig


# 6. Megatron's DistributedDataParallel and optimizers (optimizer.py, distrib_optimizer.py) on CPU.
#    They hard-code CUDA in three ways, each replaced only inside `megatron_optimizer_on_cpu()`:
#    a. allocations with device="cuda" / torch.cuda.current_device() (grad and param buffers,
#       found_inf, the clip's norm tensors): the modules' `torch` is the CPU proxy of cuda_to_cpu;
#    b. dtype checks by type string: `param.type() == 'torch.cuda.FloatTensor'` when building the
#       main-param groups and in get_grad_norm_fp32; a CPU tensor reports 'torch.FloatTensor', so
#       Tensor.type() without arguments reports the CUDA name of a CPU tensor (the dtype is the same);
#    c. `tensor.cuda()` before a gather in the distributed optimizer's state gather: identity;
#    (torch Adam's "step" on loading a reshardable checkpoint is not a CPU matter: it fails on GPUs
#    without TE / apex too, so megatron_core_0_16_1_torch_adam_load.py holds it out on any device.)
#    Overlapped grad reduce / param gather (CUDA streams) and NCCL buffer registration stay off:
#    the learner builds DistributedDataParallelConfig with overlap_* False on CPU.
_OPTIMIZER_MODULES = (
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.utils",   # local_multi_tensor_l2_norm (the clip's norm without apex/TE)
)


def _cuda_type_name(orig_type):
    def type_(self, *args, **kwargs):
        if args or kwargs or self.device.type != "cpu":
            return orig_type(self, *args, **kwargs)
        name = orig_type(self)
        return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
    type_.__wrapped__ = orig_type
    return type_


@contextlib.contextmanager
def megatron_optimizer_on_cpu():
    """Scoped (restored on exit): Megatron DDP / optimizer / dist-checkpoint modules see CPU as CUDA.

    Wrap their construction and every call that runs them (backward hooks only add into CPU
    buffers and need nothing): finish_grad_sync / finalize_model_grads, optimizer.step,
    sharded_state_dict / load_state_dict.
    """
    saved_type, saved_cuda = torch.Tensor.type, torch.Tensor.cuda
    torch.Tensor.type = _cuda_type_name(saved_type)
    torch.Tensor.cuda = lambda t, *a, **k: t
    try:
        with cuda_to_cpu(_SCHEDULE_MODULES + _OPTIMIZER_MODULES):
            yield
    finally:
        torch.Tensor.type, torch.Tensor.cuda = saved_type, saved_cuda
