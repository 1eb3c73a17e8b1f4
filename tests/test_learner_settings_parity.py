"""Learner settings against verl, and two learner gaps (review):

1. PPO's critic has its own weight decay and gradient clip (`algorithm.critic_weight_decay`,
   `critic_grad_clip`: verl's `critic.optim.weight_decay` 0.01 and `critic.grad_clip` 1.0), instead of
   the policy's `learner.weight_decay` / `grad_clip`.
2. With Megatron's distributed optimizer the global gradient norm is computed once per step (it was
   twice: get_grad_norm() for the finiteness check, then again inside optimizer.step()), with the same
   reported norm and the same weights.
3. Learner checkpoints carry CUDA's default generators (torch.cuda.get_rng_state_all) besides the CPU
   generator and Megatron's tracker; older checkpoints load as before. The CPU tests use a fake
   torch.cuda; the GPU test runs the real one.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.multiprocessing as mp
from test_learner_layouts import complete_batch, loss_config, make_batch
from test_verl_parity_s19 import ROOT, _settings_per_role

from megatron_specrl.config import ConfigError, LearnerConfig, load_config
from megatron_specrl.ports import free_port


# ------------------------------------------------------------------- 1. critic weight decay / grad clip
def test_critic_weight_decay_and_grad_clip_are_their_own_keys_with_verls_defaults():
    cfg = load_config(ROOT / "examples/tiny-cpu-ppo.yaml")
    assert cfg.algorithm.critic_weight_decay == 0.01      # verl: critic.optim.weight_decay
    assert cfg.algorithm.critic_grad_clip == 1.0          # verl: critic.grad_clip
    cfg = load_config(None, ["algorithm.critic_weight_decay=0.2", "algorithm.critic_grad_clip=0.5"])
    assert (cfg.algorithm.critic_weight_decay, cfg.algorithm.critic_grad_clip) == (0.2, 0.5)
    assert (cfg.learner.weight_decay, cfg.learner.grad_clip) == (0.0, 1.0)
    with pytest.raises(ConfigError, match="critic_weight_decay"):
        load_config(None, ["algorithm.critic_weight_decay=-1"])
    with pytest.raises(ConfigError, match="critic_grad_clip"):
        load_config(None, ["algorithm.critic_grad_clip=0"])


def _optimizer_child(rank, hf_dir, ports, roles, out):
    """Each role's worker, on both optimizers: its param groups' weight decay and its clip."""
    from megatron_specrl.learner.megatron_optim import inner_optimizers
    from megatron_specrl.learner.worker import LearnerWorker

    res = {}
    port = iter(ports)
    for role, settings in roles.items():
        for dist_opt in (False, True):
            s = settings.model_copy(update={"distributed_optimizer": dist_opt})
            w = LearnerWorker(0, 1, "127.0.0.1", next(port), s, seed=1, role=role)
            w.build(hf_dir)
            if dist_opt:
                groups = [g for o in inner_optimizers(w.optimizer) for g in o.param_groups]
                clip = w.optimizer.config.clip_grad
            else:
                groups = w.optimizer.param_groups
                for p in w._params():                 # the AdamW path clips in _finalize_grads
                    p.grad = torch.ones_like(p)
                w._finalize_grads(clip=True)
                clip = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in w._params()))
            res[(role, dist_opt)] = {"wd": sorted({g["weight_decay"] for g in groups}), "clip": clip}
            w.shutdown()
    torch.save(res, out)


@pytest.mark.slow
def test_critic_optimizer_gets_its_own_weight_decay_and_clip(tiny_llama, tmp_path):
    cfg = load_config(ROOT / "examples/tiny-cpu-ppo.yaml",
                      [f"model.path={tiny_llama}", "model.warmup_steps=0", f"output_dir={tmp_path / 'run'}",
                       "learner.weight_decay=0.0", "learner.grad_clip=1.0", "algorithm.critic_weight_decay=0.05",
                       "algorithm.critic_grad_clip=0.3", "logging.wandb=false", "data.num_eval=0"])
    seen = _settings_per_role(cfg)
    assert (seen["critic"].weight_decay, seen["critic"].grad_clip) == (0.05, 0.3)
    assert (seen["policy"].weight_decay, seen["policy"].grad_clip) == (0.0, 1.0)
    out = tmp_path / "r.pt"
    mp.spawn(_optimizer_child, args=(str(tiny_llama), [free_port("127.0.0.1") for _ in range(4)],
                                     {"policy": seen["policy"], "critic": seen["critic"]}, str(out)),
             nprocs=1, join=True)
    r = torch.load(out)
    for dist_opt in (False, True):
        assert r[("critic", dist_opt)]["wd"] == [0.05], r
        assert r[("policy", dist_opt)]["wd"] == [0.0], r
        assert r[("critic", dist_opt)]["clip"] == pytest.approx(0.3, rel=1e-5), r
        assert r[("policy", dist_opt)]["clip"] == pytest.approx(1.0, rel=1e-5), r


def test_readme_maps_the_critic_optimizer_keys_to_verl():
    readme = (ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `algorithm.gamma`"))
    for key in ("`critic_weight_decay`", "critic.optim.weight_decay", "`critic_grad_clip`", "critic.grad_clip"):
        assert key in row, key
    assert "PPO's critic shares `weight_decay` and `grad_clip`" not in readme


# ------------------------------------------------------------------ 2. one grad norm per Megatron step
def _two_norm_step(optimizer):
    """megatron_optim.step before this change: the NaN check's own norm, then optimizer.step(), which
    computes it again (the reference for the weights, the reported norm and the count)."""
    optimizer.prepare_grads()
    assert math.isfinite(optimizer.get_grad_norm())
    ok, grad_norm, _ = optimizer.step()
    return ok, grad_norm


def _norm_child(rank, hf_dir, ports, out):
    import megatron.core.optimizer.optimizer as mopt
    from megatron_specrl.learner import megatron_optim
    from megatron_specrl.learner.worker import LearnerWorker

    calls = []
    real_norm = mopt.get_grad_norm_fp32

    def spy(*a, **k):
        calls.append(1)
        return real_norm(*a, **k)

    mopt.get_grad_norm_fp32 = spy     # what get_grad_norm and clip_grad_norm call (optimizer.py's import)
    settings = LearnerConfig(micro_batch_size=2, loss=loss_config(), lr=1e-2, weight_decay=0.1, grad_clip=0.05,
                             distributed_optimizer=True)
    raw = make_batch(hf_dir)
    res = {}
    for tag, port in zip(("new", "head"), ports):
        w = LearnerWorker(0, 1, "127.0.0.1", port, settings, seed=1)
        w.load_hf(hf_dir)
        batch = complete_batch(raw, w.compute_logprobs(raw))
        w.forward_backward(batch)                                 # unclipped gradients, no step
        independent = math.sqrt(sum(float(p.grad.detach().double().pow(2).sum()) for p in w._params()))
        if tag == "head":
            megatron_optim.step = _two_norm_step   # the worker calls megatron_optim.step (this child only)
        del calls[:]
        metrics = [w.train_step(batch), w.train_step(batch)]      # one optimizer step each
        res[tag] = {"independent": independent, "metrics": metrics, "norm_calls": len(calls),
                    "params": {n: p.detach().clone() for n, p in w.model.named_parameters()}}
        w.shutdown()
    torch.save(res, out)


@pytest.mark.slow
def test_distributed_optimizer_computes_the_grad_norm_once_with_the_same_norm_and_weights(tiny_llama, tmp_path):
    out = tmp_path / "r.pt"
    mp.spawn(_norm_child, args=(str(tiny_llama), [free_port("127.0.0.1") for _ in range(2)], str(out)),
             nprocs=1, join=True)
    r = torch.load(out)
    new, head = r["new"], r["head"]
    assert head["norm_calls"] == 4                 # before: twice in each of the two optimizer steps
    assert new["norm_calls"] == 2, new["norm_calls"]
    # the logged norm is the gradients' norm, computed here from them (and the clip acts on it)
    assert new["independent"] > 0.05
    assert new["metrics"][0]["grad_norm"] == pytest.approx(new["independent"], rel=1e-5)
    # and the same numbers and weights as the two-norm step
    assert new["metrics"] == head["metrics"]
    assert new["params"].keys() == head["params"].keys()
    for n in new["params"]:
        assert torch.equal(new["params"][n], head["params"][n]), n


# ------------------------------------------------------------------------ 3. CUDA RNG in checkpoints
class FakeCuda:
    """torch.cuda's RNG surface for `n` devices (states: distinct byte tensors)."""

    def __init__(self, n: int, available: bool = True, base: int = 0):
        self.available = available
        self.states = [torch.full((8,), base + i, dtype=torch.uint8) for i in range(n)]
        self.set_all_calls = 0

    def is_available(self):
        return self.available

    def device_count(self):
        return len(self.states) if self.available else 0

    def get_rng_state_all(self):
        return list(self.states)            # as torch: fresh tensors, but test that they are copied

    def set_rng_state_all(self, states):
        assert len(states) == len(self.states)
        self.set_all_calls += 1
        self.states = [s.clone() for s in states]

    def set_rng_state(self, state, device):
        self.states[device] = state.clone()


def test_cuda_rng_states_none_without_cuda_and_copies_with():
    from megatron_specrl.learner.worker import cuda_rng_states
    assert cuda_rng_states(FakeCuda(2, available=False)) is None
    fake = FakeCuda(2)
    saved = cuda_rng_states(fake)
    assert [int(s[0]) for s in saved] == [0, 1]
    fake.states[0].fill_(9)                 # a later draw must not change what was saved
    assert int(saved[0][0]) == 0


def test_restore_cuda_rng_states_same_count_missing_and_no_cuda():
    from megatron_specrl.learner.worker import cuda_rng_states, restore_cuda_rng_states
    saved = cuda_rng_states(FakeCuda(2, base=10))
    fake = FakeCuda(2)
    assert restore_cuda_rng_states(saved, fake) == 2
    assert fake.set_all_calls == 1 and [int(s[0]) for s in fake.states] == [10, 11]
    for old in (None, []):                  # a checkpoint from before the key, or saved without CUDA
        fake = FakeCuda(2)
        assert restore_cuda_rng_states(old, fake) == 0 and [int(s[0]) for s in fake.states] == [0, 1]
    assert restore_cuda_rng_states(saved, FakeCuda(2, available=False)) == 0   # GPU checkpoint on CPU


def test_restore_cuda_rng_states_other_gpu_count_restores_what_fits_and_warns(caplog):
    from megatron_specrl.learner.worker import cuda_rng_states, restore_cuda_rng_states
    saved = cuda_rng_states(FakeCuda(2, base=10))
    fewer = FakeCuda(1)
    with caplog.at_level(logging.WARNING, logger="megatron_specrl.learner.worker"):
        assert restore_cuda_rng_states(saved, fewer) == 1
    assert [int(s[0]) for s in fewer.states] == [10]
    assert "2 GPU(s), 1 visible" in caplog.text and "\n" not in caplog.records[-1].getMessage()
    more = FakeCuda(3)
    assert restore_cuda_rng_states(saved, more) == 2
    assert [int(s[0]) for s in more.states] == [10, 11, 2]     # device 2 keeps its seeded state


def _bare_worker():
    from megatron_specrl.learner.worker import LearnerWorker
    w = object.__new__(LearnerWorker)
    w.settings, w.pp_rank, w.tp_rank, w.dp_rank = LearnerConfig(), 0, 0, 0
    return w


@pytest.mark.parametrize("available", [True, False])
def test_checkpoint_rng_state_holds_cuda_generators_when_cuda_is_available(monkeypatch, available):
    from megatron_specrl.learner import worker
    fake = FakeCuda(2, available=available, base=5)
    real = worker.cuda_rng_states
    monkeypatch.setattr(worker, "cuda_rng_states", lambda: real(fake))
    rng = _bare_worker()._with_rng({})["rng"].data
    assert set(rng) == ({"cpu", "tracker", "cuda"} if available else {"cpu", "tracker"})   # CPU: as before
    if available:
        assert [int(s[0]) for s in rng["cuda"]] == [5, 6]


def _rng_round_trip_child(rank, hf_dir, ports, out):
    """save_checkpoint / load_checkpoint with a fake torch.cuda in the worker's RNG helpers."""
    from megatron_specrl.learner import worker
    real_get, real_restore = worker.cuda_rng_states, worker.restore_cuda_rng_states
    res = {}
    for tag, save_with_cuda in (("new", True), ("old", False)):
        fake = FakeCuda(1, available=save_with_cuda, base=40)
        worker.cuda_rng_states = lambda: real_get(fake)
        worker.restore_cuda_rng_states = lambda saved: real_restore(saved, fake)
        w = worker.LearnerWorker(0, 1, "127.0.0.1", ports[tag], LearnerConfig(micro_batch_size=2), seed=1)
        w.load_hf(hf_dir)
        ckpt = f"{out}.{tag}"
        w.save_checkpoint(ckpt)
        fake.available = True                 # resumed on a GPU; its generator moved on since the save
        fake.states = [torch.full((8,), 99, dtype=torch.uint8)]
        w.load_checkpoint(ckpt)
        res[tag] = int(fake.states[0][0])
        w.shutdown()
    torch.save(res, out)


@pytest.mark.slow
def test_checkpoint_restores_cuda_generators_and_loads_older_checkpoints(tiny_llama, tmp_path):
    out = tmp_path / "r.pt"
    mp.spawn(_rng_round_trip_child,
             args=(str(tiny_llama), {"new": free_port("127.0.0.1"), "old": free_port("127.0.0.1")}, str(out)),
             nprocs=1, join=True)
    r = torch.load(out)
    assert r["new"] == 40       # the saved CUDA generator state is back
    assert r["old"] == 99       # no "cuda" in the checkpoint (older / CPU): generators untouched, no error


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
