"""Where the learner differed from verl without saying so:

1. PPO's critic has its own lr warm-up (`algorithm.critic_lr_warmup_steps`, verl's
   `critic.optim.lr_warmup_steps`, default none): `learner.lr_warmup_steps` warms up the policy only, so the
   critic's first step trains at the full `algorithm.critic_lr` while the actor's trains at 0.
2. `seq-mean-token-sum-norm`: ours is Dr. GRPO's mean over sequences (independent of the microbatch split
   and of DP); verl's is not one number (below), so README states the factor instead of "carries over".
3. A row longer than `learner.max_tokens_per_microbatch` is an error (verl asserts the same), and a config
   whose longest possible row (data.max_prompt_len + rollout.max_new_tokens) does not fit is refused.

Learner settings against verl, and two learner gaps (review):

1. PPO's critic has its own weight decay and gradient clip (`algorithm.critic_weight_decay`,
   `critic_grad_clip`: verl's `critic.optim.weight_decay` 0.01 and `critic.grad_clip` 1.0), instead of
   the policy's `learner.weight_decay` / `grad_clip`.
2. With Megatron's distributed optimizer the global gradient norm is computed once per step (it was
   twice: get_grad_norm() for the finiteness check, then again inside optimizer.step()), with the same
   reported norm and the same weights.
3. Learner checkpoints carry CUDA's default generators (torch.cuda.get_rng_state_all) besides the CPU
   generator and Megatron's tracker; older checkpoints load as before. The CPU tests use a fake
   torch.cuda; the GPU test runs the real one.

The learner's algorithm code: regression tests for properties verl users rely on and
that no other test pins at the worker level.

- A mini-batch's gradient does not depend on how it is cut into microbatches (fixed sizes or token-budget
  packs), for every loss_agg_mode, with the KL, entropy and TIS terms on.
- learner.mini_batches / ppo_epochs: one train_step with mini_batches=2, ppo_epochs=2 is the same four
  optimizer steps as four single-mini-batch train_steps on the halves, in verl's order (each epoch walks
  the mini-batches in order), with the same old log-probs throughout.
"""

from __future__ import annotations
from unittest import mock
import pytest
import torch
from megatron_specrl.config import ConfigError, LearnerConfig, load_config
from megatron_specrl.config.resolve import resolve
from megatron_specrl.learner import losses as L
import logging
import math
import torch.multiprocessing as mp
from tests.helpers.learner import complete_batch, loss_config, make_batch, one_rank_state
from megatron_specrl.learner.ports import free_port
from tests.helpers.paths import REPO_ROOT



# ---- Where the learner differed from verl without saying so:

ROOT = REPO_ROOT


# ----------------------------------------------------------------------------------------- 1. critic warm-up
def test_critic_lr_warmup_steps_is_its_own_key_default_off():
    cfg = load_config(ROOT / "examples/tiny-cpu-ppo.yaml", ["learner.lr_warmup_steps=5"])
    assert cfg.algorithm.critic_lr_warmup_steps == 0
    assert load_config(None, ["algorithm.critic_lr_warmup_steps=3"]).algorithm.critic_lr_warmup_steps == 3
    with pytest.raises(ConfigError, match="critic_lr_warmup_steps"):
        load_config(None, ["algorithm.critic_lr_warmup_steps=-1"])


def _settings_per_role(cfg) -> dict[str, LearnerConfig]:
    """What run.build.build_run hands each learner group (actors.build_actors with fake groups / engine)."""
    from megatron_specrl.cluster import actors
    from megatron_specrl.run import build as run_build
    from megatron_specrl.engines import factory

    captured_kwargs = {}

    class Stop(Exception):
        pass

    def capture(*args, **kwargs):
        captured_kwargs.update(kwargs, _args=args)
        raise Stop

    with mock.patch.object(actors, "init_ray"), mock.patch.object(actors, "build_actors", capture), \
            mock.patch.object(run_build, "cluster_gpus", lambda: []), \
            mock.patch.object(run_build, "plan_placement", lambda cfg, gpus: mock.Mock(
                learner_gpus_per_rank=0.0, gpus_per_engine=None)), \
            mock.patch.object(run_build, "resolve_transport", lambda *a: "ray"):
        with pytest.raises(Stop):
            run_build.build_run(resolve(cfg))
    args = captured_kwargs.pop("_args")

    seen = {}

    def fake_group(settings, seed, role="policy", **kw):
        seen[role] = settings
        return mock.Mock()

    with mock.patch.object(actors, "LearnerGroup", fake_group), \
            mock.patch.object(factory, "make_engine", lambda *a, **k: mock.Mock()):
        actors.build_actors(*args, **captured_kwargs)
    return seen


def _first_step_lr(settings: LearnerConfig) -> float:
    """The lr LearnerWorker.train_step sets for its first step (train_steps 0), on a bare worker."""
    from megatron_specrl.learner.worker import LearnerWorker
    w = object.__new__(LearnerWorker)
    w.settings, w.train_steps = settings, 0
    w.optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=settings.lr)
    lr = w._set_lr()
    assert w.optimizer.param_groups[0]["lr"] == lr
    return lr


def test_critic_first_step_uses_full_critic_lr_while_actor_warms_up(tiny_llama, tmp_path):
    cfg = load_config(ROOT / "examples/tiny-cpu-ppo.yaml",
                      [f"model.path={tiny_llama}", "model.warmup_steps=0", f"output_dir={tmp_path / 'run'}",
                       "learner.lr=1e-3", "learner.lr_warmup_steps=4", "algorithm.critic_lr=5e-4",
                       "logging.wandb=false", "data.num_eval=0"])
    seen = _settings_per_role(cfg)
    assert set(seen) == {"policy", "critic"}
    assert _first_step_lr(seen["policy"]) == 0.0          # verl's warm-up: lr x 0 / 4 on the first step
    assert seen["critic"].lr == 5e-4 and seen["critic"].lr_warmup_steps == 0
    assert _first_step_lr(seen["critic"]) == 5e-4         # verl's critic.optim: no warm-up by default
    # and the critic's own key warms the critic up (only)
    cfg.algorithm.critic_lr_warmup_steps = 2
    seen = _settings_per_role(cfg)
    assert seen["critic"].lr_warmup_steps == 2 and seen["policy"].lr_warmup_steps == 4
    assert _first_step_lr(seen["critic"]) == 0.0


def test_algorithms_page_maps_the_critic_warmup_key_to_verl():
    readme = (ROOT / "docs" / "algorithms.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `algorithm.gamma`"))
    assert "`critic_lr_warmup_steps`" in row and "critic.optim.lr_warmup_steps" in row


# ------------------------------------------------------------------------- 2. seq-mean-token-sum-norm scale
def _loss_mat():
    g = torch.Generator().manual_seed(0)
    loss_mat = torch.randn(6, 5, generator=g, dtype=torch.float64)
    mask = (torch.rand(6, 5, generator=g) > 0.3).double()
    mask[4] = 0                                           # an empty response
    return loss_mat, mask


def test_seq_mean_token_sum_norm_by_hand_and_split_invariant():
    """Ours: sum over the mini-batch's sequences of (token sum / F), over the number of non-empty sequences
    (Dr. GRPO's 1/G), the same for any microbatch split when the global denominator is passed."""
    loss_mat, mask = _loss_mat()
    F = 5.0
    sums = [sum(float(loss_mat[i, t]) for t in range(5) if mask[i, t]) for i in range(6)]
    n_seq = sum(1 for i in range(6) if mask[i].sum() > 0)
    by_hand = sum(s / F for s in sums) / n_seq
    whole = L.aggregate(loss_mat, mask, "seq-mean-token-sum-norm", loss_scale_factor=F)
    assert whole.item() == pytest.approx(by_hand, rel=1e-12)
    denom = L.aggregation_denominator(mask, "seq-mean-token-sum-norm")
    for cut in ([2, 4], [1, 3, 5], [5]):
        parts = torch.tensor_split(torch.arange(6), cut)
        split = sum(L.aggregate(loss_mat[p], mask[p], "seq-mean-token-sum-norm", denom, F) for p in parts)
        assert split.item() == pytest.approx(by_hand, rel=1e-12)


def test_verl_seq_mean_token_sum_norm_is_ours_times_the_microbatch_size_legacy_workers():
    """verl's default (legacy) workers, fixed microbatches of m: each microbatch's loss is its token sum / F
    (no division by its sequences), scaled by 1 / gradient_accumulation = m / mini; summed over the
    mini-batch that is m x ours. With use_dynamic_bsz (scale n_mb / mini) it depends on the packing."""
    loss_mat, mask = _loss_mat()
    mask[4] = 1                                           # verl's count is rows, ours non-empty rows: equal here
    F, mini, m = 5.0, 6, 2
    ours = L.aggregate(loss_mat, mask, "seq-mean-token-sum-norm", loss_scale_factor=F).item()
    verl_fixed = sum(float((loss_mat[i:i + m] * mask[i:i + m]).sum()) / F * (m / mini) for i in range(0, mini, m))
    assert verl_fixed == pytest.approx(m * ours, rel=1e-12)

    def verl_dynamic(packs):
        return sum(float((loss_mat[p] * mask[p]).sum()) / F * (len(p) / mini) for p in packs)
    a = verl_dynamic([[0, 1, 2], [3, 4, 5]])
    b = verl_dynamic([[0], [1, 2, 3, 4, 5]])
    assert a != pytest.approx(b, rel=1e-6)                # the same mini-batch, two losses
    # verl's new engine workers (use_legacy_worker_impl=disable): the sum over a rank's microbatches of
    # token sum / F, averaged over DP: (sequences per DP rank) x ours
    dp = 2
    per_rank = [range(0, 3), range(3, 6)]
    verl_engine = sum(float((loss_mat[list(r)] * mask[list(r)]).sum()) / F for r in per_rank) / dp
    assert verl_engine == pytest.approx(mini / dp * ours, rel=1e-12)


def test_algorithms_page_states_the_seq_mean_token_sum_norm_factor_against_verl():
    readme = (ROOT / "docs" / "algorithms.md").read_text()
    assert "verl's values carry over unchanged under these keys:" not in readme
    row = next(line for line in readme.splitlines() if line.startswith("| `learner.loss.agg_mode`"))
    assert "ppo_micro_batch_size_per_gpu" in row and "grad_clip" in row
    factor = next(line for line in readme.splitlines() if line.startswith("| `learner.loss.loss_scale_factor`"))
    assert "legacy" in factor


# ------------------------------------------------------------------------ 3. rows over the token budget
def test_a_row_over_the_token_budget_is_an_error_naming_length_and_budget():
    from megatron_specrl.learner.worker import split_microbatches
    assert split_microbatches([0, 1, 2], [8, 10, 4], 32, 20) == [[0, 1], [2]]
    assert split_microbatches([0, 1], [20, 20], 32, 20) == [[0], [1]]      # exactly the budget fits
    with pytest.raises(ValueError) as e:
        split_microbatches([0, 1, 2], [8, 21, 4], 32, 20)
    msg = str(e.value)
    assert "\n" not in msg and "21" in msg and "learner.max_tokens_per_microbatch=20" in msg
    # fixed-size microbatches have no token budget
    assert split_microbatches([0, 1], [500, 9], 1, None) == [[0], [1]]


def test_config_refuses_a_token_budget_below_the_longest_possible_row():
    base = ["data.max_prompt_len=64", "rollout.max_new_tokens=64", "rollout.max_model_len=256"]
    assert load_config(None, base + ["learner.max_tokens_per_microbatch=128"]).learner.max_tokens_per_microbatch == 128
    with pytest.raises(ConfigError) as e:
        load_config(None, base + ["learner.max_tokens_per_microbatch=100"])
    msg = str(e.value)
    assert "\n" not in msg
    for key in ("learner.max_tokens_per_microbatch=100", "data.max_prompt_len", "rollout.max_new_tokens", "128"):
        assert key in msg, (key, msg)
    assert load_config(None, base).learner.max_tokens_per_microbatch is None   # unset: no budget to check


@pytest.mark.parametrize("recipe", sorted(p.stem for p in (ROOT / "examples").glob("*.yaml")))
def test_shipped_recipes_fit_their_longest_row_in_the_token_budget(recipe, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = load_config(ROOT / "examples" / f"{recipe}.yaml")
    budget = cfg.learner.max_tokens_per_microbatch
    assert budget is None or budget >= cfg.data.max_prompt_len + cfg.rollout.max_new_tokens


# ---- Learner settings against verl, and two learner gaps (review):

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


def test_algorithms_page_maps_the_critic_optimizer_keys_to_verl():
    readme = (ROOT / "docs" / "algorithms.md").read_text()
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
    from megatron_specrl.learner.checkpoint_io import cuda_rng_states
    assert cuda_rng_states(FakeCuda(2, available=False)) is None
    fake = FakeCuda(2)
    saved = cuda_rng_states(fake)
    assert [int(s[0]) for s in saved] == [0, 1]
    fake.states[0].fill_(9)                 # a later draw must not change what was saved
    assert int(saved[0][0]) == 0


def test_restore_cuda_rng_states_same_count_missing_and_no_cuda():
    from megatron_specrl.learner.checkpoint_io import cuda_rng_states, restore_cuda_rng_states
    saved = cuda_rng_states(FakeCuda(2, base=10))
    fake = FakeCuda(2)
    assert restore_cuda_rng_states(saved, fake) == 2
    assert fake.set_all_calls == 1 and [int(s[0]) for s in fake.states] == [10, 11]
    for old in (None, []):                  # a checkpoint from before the key, or saved without CUDA
        fake = FakeCuda(2)
        assert restore_cuda_rng_states(old, fake) == 0 and [int(s[0]) for s in fake.states] == [0, 1]
    assert restore_cuda_rng_states(saved, FakeCuda(2, available=False)) == 0   # GPU checkpoint on CPU


def test_restore_cuda_rng_states_other_gpu_count_restores_what_fits_and_warns(caplog):
    from megatron_specrl.learner.checkpoint_io import cuda_rng_states, restore_cuda_rng_states
    saved = cuda_rng_states(FakeCuda(2, base=10))
    fewer = FakeCuda(1)
    with caplog.at_level(logging.WARNING, logger="megatron_specrl.learner.checkpoint_io"):
        assert restore_cuda_rng_states(saved, fewer) == 1
    assert [int(s[0]) for s in fewer.states] == [10]
    assert "2 GPU(s), 1 visible" in caplog.text and "\n" not in caplog.records[-1].getMessage()
    more = FakeCuda(3)
    assert restore_cuda_rng_states(saved, more) == 2
    assert [int(s[0]) for s in more.states] == [10, 11, 2]     # device 2 keeps its seeded state


@pytest.mark.parametrize("available", [True, False])
def test_checkpoint_rng_state_holds_cuda_generators_when_cuda_is_available(monkeypatch, available):
    from megatron_specrl.learner import checkpoint_io
    fake = FakeCuda(2, available=available, base=5)
    real = checkpoint_io.cuda_rng_states
    monkeypatch.setattr(checkpoint_io, "cuda_rng_states", lambda: real(fake))
    rng = checkpoint_io.with_rng(one_rank_state(), {})["rng"].data
    assert set(rng) == ({"cpu", "tracker", "cuda"} if available else {"cpu", "tracker"})   # CPU: as before
    if available:
        assert [int(s[0]) for s in rng["cuda"]] == [5, 6]


def _rng_round_trip_child(rank, hf_dir, ports, out):
    """save_checkpoint / load_checkpoint with a fake torch.cuda in the worker's RNG helpers."""
    from megatron_specrl.learner import checkpoint_io, worker
    real_get, real_restore = checkpoint_io.cuda_rng_states, checkpoint_io.restore_cuda_rng_states
    res = {}
    for tag, save_with_cuda in (("new", True), ("old", False)):
        fake = FakeCuda(1, available=save_with_cuda, base=40)
        checkpoint_io.cuda_rng_states = lambda: real_get(fake)
        checkpoint_io.restore_cuda_rng_states = lambda saved: real_restore(saved, fake)
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




# ---- The learner's algorithm code: regression tests for properties verl users rely on and

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _batch(w, B=4, T=12):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (B, T), generator=g)
    lengths = torch.tensor([12, 7, 9, 5])
    am = (torch.arange(T)[None] < lengths[:, None]).long()
    mask = am.float().clone()
    mask[:, :3] = 0                       # the prompt
    batch = {"input_ids": ids, "attention_mask": am, "loss_mask": mask,
             "advantages": torch.randn(B, 1, generator=g) * mask}
    lp = w.compute_logprobs(batch)
    batch["rollout_logprobs"] = (lp + 0.1 * torch.randn(B, T, generator=g)) * am
    batch["old_logprobs"] = (lp + 0.05 * torch.randn(B, T, generator=g)) * am
    batch["ref_logprobs"] = (lp + 0.2 * torch.randn(B, T, generator=g)) * am
    return batch


def _child(rank, hf_dir, port, out):
    from megatron_specrl.config import LearnerConfig, LossConfig
    from megatron_specrl.learner.worker import LearnerWorker

    def loss(mode):
        return LossConfig(tis="token", agg_mode=mode, loss_scale_factor=8.0, kl_coef=0.1, entropy_coef=0.01)

    w = LearnerWorker(0, 1, "127.0.0.1", port, LearnerConfig(recompute_old_logprobs=False), seed=1)
    w.load_hf(hf_dir)
    init = {n: p.detach().clone() for n, p in w.model.named_parameters()}
    batch = _batch(w)
    split = {}
    for mode in AGG_MODES:
        grads = []
        for mbs, budget in ((4, None), (1, None), (3, None), (32, 20)):
            w.settings = LearnerConfig(micro_batch_size=mbs, max_tokens_per_microbatch=budget,
                                       recompute_old_logprobs=False, loss=loss(mode))
            metrics = w.forward_backward(batch)
            grads.append((torch.cat([p.grad.flatten().clone() for p in w._params()]), metrics["loss"]))
        split[mode] = grads

    def reset(settings):
        with torch.no_grad():
            for n, p in w.model.named_parameters():
                p.copy_(init[n])
        w.settings = settings
        w.train_steps = 0
        w._build_optimizer()

    lc = loss("seq-mean-token-mean")
    reset(LearnerConfig(micro_batch_size=1, mini_batches=2, ppo_epochs=2, recompute_old_logprobs=False, loss=lc))
    w.train_step(batch)
    one_call = {n: p.detach().clone() for n, p in w.model.named_parameters()}
    reset(LearnerConfig(micro_batch_size=2, recompute_old_logprobs=False, loss=lc))
    for _epoch in range(2):
        for half in ([0, 1], [2, 3]):
            w.train_step({k: v[half] for k, v in batch.items()})
    four_calls = {n: p.detach().clone() for n, p in w.model.named_parameters()}
    torch.save({"split": split,
                "mini_diff": max(float((one_call[n] - four_calls[n]).abs().max()) for n in init),
                "moved": max(float((one_call[n] - init[n]).abs().max()) for n in init)}, out)
    w.shutdown()


@pytest.fixture(scope="module")
def results(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("minibatch-steps") / "r.pt"
    mp.spawn(_child, args=(str(tiny_llama), free_port("127.0.0.1"), str(out)), nprocs=1, join=True)
    return torch.load(out)


@pytest.mark.slow
@pytest.mark.parametrize("mode", AGG_MODES)
def test_minibatch_gradient_does_not_depend_on_the_microbatch_split(results, mode):
    (base, base_loss), *others = results["split"][mode]
    assert base.abs().max() > 1e-3
    for g, loss in others:
        assert torch.allclose(g, base, rtol=1e-4, atol=1e-5), float((g - base).abs().max())
        assert loss == pytest.approx(base_loss, rel=1e-5)


@pytest.mark.slow
def test_mini_batches_and_ppo_epochs_are_sequential_steps_on_the_halves(results):
    assert results["moved"] > 1e-5                  # the steps did train
    assert results["mini_diff"] < 1e-5, results   # float noise only (measured 6e-7; the steps move 4e-4)
