"""The learner's GPU paths: what works on CPU / gloo but fails on CUDA, where the deciding
logic runs on CPU too.

1. The TransformerEngine layer spec (model_provider picks it on GPUs with TE installed) names the fused
   pre-norms `linear_qkv.layer_norm_weight` / `linear_fc1.layer_norm_weight`; the HF converter names the
   local spec's `input_layernorm.weight` / `pre_mlp_layernorm.weight`. load_hf must load one into the other
   (it refused every TE model: "no weights for Megatron parameter ...layer_norm_weight").
2. Colocated on GPUs the policy's, critic's and reference's ranks and the vLLM engine share each GPU: a
   learner pass (scoring, a train step, its part of a resync) hands the blocks torch's caching allocator
   kept back to the driver (torch.cuda.empty_cache), else the engine's wake_up and the next learner
   process find them taken.
"""

from __future__ import annotations
from types import SimpleNamespace
import pytest
import torch
from megatron_specrl.learner import hf_mapping as hm
from megatron_specrl.learner import worker as worker_mod
from megatron_specrl.learner.worker import LearnerWorker

H = 4


def _module(**children) -> torch.nn.Module:
    m = torch.nn.Module()
    for k, v in children.items():
        setattr(m, k, v)
    return m


def _te_layer_model() -> torch.nn.Module:
    """One decoder layer named as Megatron's TransformerEngine spec names it (norms fused into the linears)."""
    zeros = lambda *s: torch.nn.Parameter(torch.zeros(*s))  # noqa: E731
    layer = _module(
        self_attention=_module(linear_qkv=_module(weight=zeros(3 * H, H), layer_norm_weight=zeros(H)),
                               linear_proj=_module(weight=zeros(H, H))),
        mlp=_module(linear_fc1=_module(weight=zeros(4 * H, H), layer_norm_weight=zeros(H)),
                    linear_fc2=_module(weight=zeros(H, 2 * H))))
    return _module(decoder=_module(layers=torch.nn.ModuleList([layer]), final_layernorm=_module(weight=zeros(H))))


def _converted(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What hf_to_megatron_shards gives this rank: local-spec names (hf_mapping.LLAMA), distinct values."""
    te_to_local = {te: local for local, te in hm.TE_RENAMES.items()}
    out = {}
    for i, (name, p) in enumerate(model.named_parameters()):
        for te, local in te_to_local.items():
            if name.endswith(te):
                name = name[: -len(te)] + local
        out[name] = torch.full(p.shape, float(i + 1))
    return out


def _loader(model) -> SimpleNamespace:
    return SimpleNamespace(model=model, role="policy", tp_rank=0, pp_rank=0)


def test_load_local_shards_fills_transformer_engine_named_norms():
    model = _te_layer_model()
    local = _converted(model)
    assert "decoder.layers.0.input_layernorm.weight" in local    # the converter's name for the TE model's norm
    LearnerWorker._load_local_shards(_loader(model), dict(local))
    params = dict(model.named_parameters())
    assert torch.equal(params["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"],
                       local["decoder.layers.0.input_layernorm.weight"])
    assert torch.equal(params["decoder.layers.0.mlp.linear_fc1.layer_norm_weight"],
                       local["decoder.layers.0.pre_mlp_layernorm.weight"])
    assert all(p.abs().sum() > 0 for p in params.values())       # every parameter was loaded


def test_load_local_shards_still_refuses_missing_and_extra_tensors_under_te_names():
    model = _te_layer_model()
    local = _converted(model)
    missing = dict(local)
    del missing["decoder.layers.0.pre_mlp_layernorm.weight"]
    with pytest.raises(hm.CheckpointError, match="mlp.linear_fc1.layer_norm_weight"):
        LearnerWorker._load_local_shards(_loader(model), missing)
    extra = {**local, "decoder.layers.0.mlp.linear_fc3.weight": torch.zeros(1)}
    with pytest.raises(hm.CheckpointError, match="linear_fc3"):
        LearnerWorker._load_local_shards(_loader(model), extra)


# --------------------------------------------------------------------------- 2. cached GPU memory


class _FakeCuda:
    def __init__(self, available: bool):
        self.available, self.emptied = available, 0

    def is_available(self):
        return self.available

    def empty_cache(self):
        self.emptied += 1


def test_release_cached_gpu_memory_empties_the_cache_only_with_cuda():
    gpu, cpu = _FakeCuda(True), _FakeCuda(False)
    assert worker_mod.release_cached_gpu_memory(gpu) is True and gpu.emptied == 1
    assert worker_mod.release_cached_gpu_memory(cpu) is False and cpu.emptied == 0


@pytest.fixture
def calls(monkeypatch):
    log: list[str] = []
    monkeypatch.setattr(worker_mod, "release_cached_gpu_memory", lambda *a, **k: log.append("release"))
    return log


def _bare_worker(cls, role: str, calls: list, rank: int = 0):
    w = cls.__new__(cls)
    w.role, w.frozen, w.rank, w.train_steps = role, False, rank, 0
    w.settings = SimpleNamespace(recompute_old_logprobs=False, mini_batches=2, ppo_epochs=1)
    w._set_lr = lambda: 0.5
    w._optimizer_step = lambda batch, rows: calls.append("step") or {"loss": 1.0}
    w._score = lambda batch, to_all: calls.append("score") or torch.zeros(2, 3)
    w.device = torch.device("cpu")
    return w


def test_train_step_and_scoring_release_the_cache_after_their_passes(calls):
    batch = {"input_ids": torch.zeros(2, 3, dtype=torch.long), "loss_mask": torch.ones(2, 3)}
    critic = _bare_worker(LearnerWorker, "critic", calls)
    assert critic.train_step(batch)["loss"] == 1.0
    assert calls == ["step", "step", "release"]
    calls.clear()
    critic.compute_values(batch)
    assert calls == ["score", "release"]
    calls.clear()
    _bare_worker(LearnerWorker, "reference", calls).compute_logprobs(batch)
    assert calls == ["score", "release"]


def _bucket_source(calls: list, n: int = 2):
    from megatron_specrl.resync.buckets import Bucket

    def gen():
        for i in range(n):
            calls.append(f"bucket{i}")
            yield Bucket.from_tensors([(f"w{i}", torch.full((2,), float(i)))])
    return lambda bucket_bytes, dtype, miswire: gen()


@pytest.mark.parametrize("rank", [0, 1])
def test_every_resync_path_releases_the_cache_once_its_buckets_are_done(calls, rank):
    from megatron_specrl.resync.learner_actor import RayLearnerWorker

    w = _bare_worker(RayLearnerWorker, "policy", calls, rank=rank)
    w._buckets = _bucket_source(calls)
    list(w.hf_bucket_stream(1))
    assert calls == ["bucket0", "bucket1", "release"]
    calls.clear()
    w.push_ipc_buckets(1, [], version=1, timeout_s=5.0)    # rank 0: CPU "IPC" (shared memory), no engines
    assert calls == ["bucket0", "bucket1", "release"]
    calls.clear()
    if rank:   # the other ranks only drain the gather
        w.broadcast_buckets(1)
        assert calls == ["bucket0", "bucket1", "release"]
    else:      # rank 0 in no broadcast group: the sync fails, the cache is released all the same
        from megatron_specrl.resync.group import ResyncTransportError
        with pytest.raises(ResyncTransportError, match="not in a broadcast group"):
            w.broadcast_buckets(1)
        assert calls[-1] == "release"
