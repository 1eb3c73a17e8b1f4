"""learner.distributed_optimizer: Megatron's DDP + distributed Adam on CPU (gloo), against the replicated
torch AdamW path; its dist checkpoints reshard across layouts.

One spawn of two ranks runs four layouts in turn (process starts dominate the cost); children write
results, the parent asserts.
"""

from __future__ import annotations
import math
import pytest
import torch
from tests.helpers.learner import complete_batch, hf_reference, loss_config, make_batch
from megatron_specrl.learner.ports import free_port

STEPS = 3


def _settings(tp, pp, dp, dist_opt):
    from megatron_specrl.config import LearnerConfig
    # A small clip so that the global-norm clip acts; weight decay on, to check it matches too.
    return LearnerConfig(tp=tp, pp=pp, dp=dp, micro_batch_size=1, loss=loss_config(), lr=1e-2,
                         weight_decay=0.1, grad_clip=0.05, distributed_optimizer=dist_opt)


def _optimizer_bytes(w, experts: bool = False) -> int:
    """Bytes of Adam moments this rank holds (`experts`: of the expert-parallel parameters only)."""
    def nbytes(st):
        return sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    if w.ddp is not None:
        from megatron_specrl.learner import megatron_optim
        if not experts:
            return megatron_optim.optimizer_state_bytes(w.optimizer)
        return sum(nbytes(opt.state[p]) for opt in megatron_optim.inner_optimizers(w.optimizer)
                   for g in opt.param_groups
                   if g.get("is_expert_parallel") for p in g["params"] if p in opt.state)
    return sum(nbytes(st) for p, st in w.optimizer.state.items() if not experts or not getattr(p, "allreduce", True))


def _child(rank, world, hf_dir, out_dir, ports):
    from megatron_specrl.learner.megatron_optim import adam_step_count
    from megatron_specrl.learner.worker import LearnerWorker

    ref = torch.load(f"{out_dir}/ref.pt")
    batch = complete_batch(ref["batch"], ref["lp"])
    ckpt = f"{out_dir}/ckpt_dp2"
    layouts = [("dp2_adamw", (1, 1, 2, False)), ("dp2_dist", (1, 1, 2, True)),
               ("tp2_dist", (2, 1, 1, True)), ("pp2_dist", (1, 2, 1, True))]
    for (tag, (tp, pp, dp, dist_opt)), port in zip(layouts, ports):
        w = LearnerWorker(rank, world, "127.0.0.1", port, _settings(tp, pp, dp, dist_opt), seed=1)
        w.load_hf(hf_dir)
        res = {"param_bytes": sum(p.numel() * p.element_size() for p in w._params())}
        if tag.startswith("dp2"):
            w.forward_backward(batch)                                # unclipped, un-stepped gradients
            res["grads"] = dict(w.iter_hf_state(grads=True))
            res["metrics"] = []
            for i in range(STEPS):
                if tag == "dp2_dist" and i == STEPS - 1:
                    w.save_checkpoint(ckpt)
                    res["saved"] = dict(w.iter_hf_state())
                res["metrics"].append(w.train_step(batch))
        else:                                                    # resume the DP2 checkpoint here
            w.load_checkpoint(ckpt)
            res["loaded"] = dict(w.iter_hf_state())
            res["adam_steps"] = adam_step_count(w.optimizer)
            w.save_checkpoint(f"{out_dir}/ckpt_{tag}")                # what this layout holds, resharded
            res["plain"] = _plain_tensors(w, ckpt), _plain_tensors(w, f"{out_dir}/ckpt_{tag}")
            res["metrics"] = [w.train_step(batch)]
        res["weights"] = dict(w.iter_hf_state())
        res["opt_bytes"] = _optimizer_bytes(w)
        torch.save(res, f"{out_dir}/{tag}.rank{rank}.pt")
        w.shutdown()


def _plain_tensors(w, path) -> dict:
    """Every tensor of a dist checkpoint, unsharded (keys are layout-independent)."""
    from megatron.core.dist_checkpointing import load_plain_tensors
    with w._cpu_shims():
        sd = load_plain_tensors(path)
    return {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}


def _two_rank_child(rank, world, hf_dir, out_dir, ports, roles_hf_dir, roles_dir, roles_ports):
    """The DP2 runs and their reshards (tiny Llama), then the critic and tied-embedding runs (tiny Qwen2), in
    the same two processes: each rank's start (torch and Megatron imports) is most of a spawn's cost."""
    _child(rank, world, hf_dir, out_dir, ports)
    _roles_child(rank, roles_hf_dir, roles_dir, roles_ports)


@pytest.fixture(scope="module")
def runs(tiny_llama, tiny_qwen2, tmp_path_factory):
    import torch.multiprocessing as mp
    tmp = tmp_path_factory.mktemp("distopt")
    batch = make_batch(tiny_llama)
    _, lp, grads = hf_reference(tiny_llama, batch, loss_config())
    torch.save({"batch": batch, "lp": lp}, tmp / "ref.pt")
    roles = tmp_path_factory.mktemp("distopt_roles")
    roles_batch = make_batch(tiny_qwen2)
    _, roles_lp, _ = hf_reference(tiny_qwen2, roles_batch, loss_config())
    torch.save({"batch": roles_batch, "lp": roles_lp}, roles / "ref.pt")
    ports, roles_ports = ([free_port("127.0.0.1") for _ in range(4)] for _ in range(2))
    mp.spawn(_two_rank_child, args=(2, str(tiny_llama), str(tmp), ports, str(tiny_qwen2), str(roles), roles_ports),
             nprocs=2, join=True)
    def load(tag, r=0):
        return torch.load(tmp / f"{tag}.rank{r}.pt")
    return {"dir": tmp, "hf_grads": grads, "load": load, "roles_dir": roles}


def _assert_close(a: dict, b: dict, atol: float, what: str):
    assert set(a) == set(b), what
    for k, v in a.items():
        assert torch.allclose(v, b[k], atol=atol, rtol=1e-5), (what, k, (v - b[k]).abs().max())


@pytest.mark.slow
def test_distributed_optimizer_matches_replicated_adamw_and_halves_its_state(runs):
    rep, dist_ = runs["load"]("dp2_adamw"), runs["load"]("dp2_dist")
    # Same DP-summed gradients as HF's full-batch gradients, through Megatron's DDP buffer.
    _assert_close(dist_["grads"], runs["hf_grads"], 1e-5, "dist-opt grads vs HF")
    _assert_close(dist_["grads"], rep["grads"], 1e-6, "dist-opt grads vs replicated")
    # Training moved the weights, the clip acted, and both paths agree step by step.
    for m_rep, m_dist in zip(rep["metrics"], dist_["metrics"]):
        assert m_rep["grad_norm"] > 0.05 and math.isclose(m_rep["grad_norm"], m_dist["grad_norm"], rel_tol=1e-4)
        assert math.isclose(m_rep["loss"], m_dist["loss"], rel_tol=1e-4, abs_tol=1e-6)
    moved = max((rep["weights"][k] - dist_["saved"][k]).abs().max() for k in rep["weights"])
    assert moved > 1e-3
    _assert_close(dist_["weights"], rep["weights"], 2e-6, "weights after 3 steps")
    # Optimizer state: the replicated path holds 2 fp32 moments per parameter on every rank; the
    # distributed optimizer holds about 1/dp of them (bucket padding aside), together all of them.
    per_rank = [runs["load"]("dp2_dist", r)["opt_bytes"] for r in (0, 1)]
    full = rep["opt_bytes"]
    assert full == 2 * rep["param_bytes"]
    # Each element's moments are held once, and no rank holds more than 1/dp of them (+1% for
    # Megatron's bucket alignment; measured: exactly 1/2 each here), which is plan.learner_memory's
    # optimizer term with learner.distributed_optimizer: ceil(2 * 4 bytes * params / dp).
    assert sum(per_rank) == full, (per_rank, full)
    for b in per_rank:
        assert 0.49 * full <= b <= math.ceil(full / 2) * 1.01, (b, full)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2_dist", "pp2_dist"])
def test_checkpoint_from_dp2_reshards_and_resumes(runs, layout):
    dist_ = runs["load"]("dp2_dist")
    other = runs["load"](layout)
    # Weights: exactly what DP2 saved; Adam's step count too.
    assert set(other["loaded"]) == set(dist_["saved"])
    assert all(torch.equal(other["loaded"][k], dist_["saved"][k]) for k in dist_["saved"])
    assert other["adam_steps"] == STEPS - 1
    # Moments: this layout re-saves what it loaded; every tensor equals the DP2 checkpoint's.
    a, b = other["plain"]
    moments = [k for k in a if "exp_avg" in k]
    assert moments and set(a) == set(b), set(a) ^ set(b)
    assert all(a[k].abs().max() > 0 for k in moments)
    for k in a:   # the vocab is padded to a multiple of 128 x TP: padding rows (zeros) differ in number
        n = min(a[k].shape[0], b[k].shape[0]) if a[k].dim() else None
        assert torch.equal(a[k][:n], b[k][:n]), k
        assert a[k][n:].count_nonzero() == 0 and b[k][n:].count_nonzero() == 0, k
    # Resuming gives DP2's third step (reduction order differs across layouts: float tolerance).
    _assert_close(other["weights"], dist_["weights"], 2e-6, f"{layout} resumed step")
    assert math.isclose(other["metrics"][0]["grad_norm"], dist_["metrics"][-1]["grad_norm"], rel_tol=1e-4)


@pytest.mark.slow
def test_resuming_with_the_other_optimizer_is_refused(runs, tiny_llama):
    """Loading Megatron distributed-optimizer state into the torch AdamW path names the key to set."""
    import torch.multiprocessing as mp
    mp.spawn(_refuse_child, args=(str(tiny_llama), str(runs["dir"]), free_port("127.0.0.1")), nprocs=1, join=True)
    assert (runs["dir"] / "refused.txt").read_text().startswith("ok")


def _refuse_child(rank, hf_dir, out_dir, port):
    from megatron_specrl.learner.hf_mapping import CheckpointError
    from megatron_specrl.learner.worker import LearnerWorker
    w = LearnerWorker(0, 1, "127.0.0.1", port, _settings(1, 1, 1, False), seed=1)
    w.load_hf(hf_dir)
    try:
        w.load_checkpoint(f"{out_dir}/ckpt_dp2")
        msg = "loaded"
    except CheckpointError as e:
        msg = "ok" if "learner.distributed_optimizer=False: set it to True" in str(e) else f"wrong: {e}"
    w.load_checkpoint(f"{out_dir}/ckpt_dp2", load_optimizer=False)    # weights alone load
    with open(f"{out_dir}/refused.txt", "w") as f:
        f.write(msg)
    w.shutdown()


def _roles_child(rank, hf_dir, out_dir, ports):
    from megatron_specrl.learner.worker import LearnerWorker
    ref = torch.load(f"{out_dir}/ref.pt")
    batch = complete_batch(ref["batch"], ref["lp"])
    g = torch.Generator().manual_seed(1)
    batch["returns"], batch["old_values"] = torch.randn(*batch["input_ids"].shape, generator=g), torch.zeros_like(ref["lp"])
    runs = [("critic", 1, 2, False), ("critic", 1, 2, True), ("policy", 2, 1, False), ("policy", 2, 1, True)]
    for (role, pp, dp, dist_opt), port in zip(runs, ports):
        w = LearnerWorker(rank, 2, "127.0.0.1", port, _settings(1, pp, dp, dist_opt), seed=1, role=role)
        w.load_hf(hf_dir)
        metrics = [w.train_step(batch) for _ in range(2)]
        res = {"metrics": metrics, "weights": dict(w.iter_hf_state())}
        if role == "critic" and w.model.output_layer is not None:          # the value head is not in HF
            res["head"] = [w.model.output_layer.weight.detach().clone()]
        torch.save(res, f"{out_dir}/{role}_pp{pp}_{dist_opt}.rank{rank}.pt")
        w.shutdown()


@pytest.mark.slow
def test_critic_and_tied_embeddings_across_stages_match_replicated(runs):
    """A critic (value head) at DP2, and a policy with tied embeddings split over PP2 (the embedding
    group's gradient all-reduce goes through finalize_model_grads): same weights on both paths. Run on tiny
    Qwen2 in the two ranks of `runs`, after its DP2 runs."""
    tmp_path = runs["roles_dir"]
    for tag in ("critic_pp1", "policy_pp2"):
        rep, dist_ = (torch.load(tmp_path / f"{tag}_{d}.rank0.pt") for d in (False, True))
        for m_rep, m_dist in zip(rep["metrics"], dist_["metrics"]):
            assert m_rep["grad_norm"] > 0 and math.isclose(m_rep["grad_norm"], m_dist["grad_norm"], rel_tol=1e-4), tag
        # Adam divides by sqrt(v): summation-order differences of tiny gradients show up at ~1e-6;
        # a step moves weights by ~lr = 1e-2.
        _assert_close(dist_["weights"], rep["weights"], 1e-5, tag)
        if tag == "critic_pp1":
            _assert_close({"head": dist_["head"][0]}, {"head": rep["head"][0]}, 1e-5, "value head")
            assert rep["head"][0].abs().max() > 0          # the zero-initialised head was trained


# ---- Expert parallelism: Qwen3-30B-A3B's recipe runs the distributed optimizer (bf16) at ep=8.
# One spawn of four ranks: DP4 x EP2 (two expert-data-parallel copies of each expert, so the expert
# gradients reduce over a group of their own) on both optimizer paths; the distributed one's checkpoint
# resumed at TP2 x DP2 x EP2 (sequence parallel, each expert split over expert TP); a bf16 learner.
MOE_LAYOUTS = [("ep2_adamw", (1, False, "float32")), ("ep2_dist", (1, True, "float32")),
               ("tp2ep2_dist", (2, True, "float32")), ("ep2_bf16", (1, True, "bfloat16"))]


def _moe_child(rank, world, hf_dir, out_dir, ports):
    from megatron_specrl.learner.megatron_optim import adam_step_count
    from megatron_specrl.learner.worker import LearnerWorker

    ref = torch.load(f"{out_dir}/ref.pt")
    batch = complete_batch(ref["batch"], ref["lp"])
    ckpt = f"{out_dir}/ckpt_ep2"
    for (tag, (tp, dist_opt, precision)), port in zip(MOE_LAYOUTS, ports):
        s = _settings(tp, 1, world // tp, dist_opt).model_copy(update={"ep": 2, "precision": precision})
        w = LearnerWorker(rank, world, "127.0.0.1", port, s, seed=1)
        w.load_hf(hf_dir)
        res = {"metrics": []}
        if tag in ("ep2_adamw", "ep2_dist"):
            w.forward_backward(batch)                                # unclipped, un-stepped gradients
            res["grads"] = dict(w.iter_hf_state(grads=True))
            for i in range(STEPS):
                if tag == "ep2_dist" and i == STEPS - 1:
                    w.save_checkpoint(ckpt)
                    res["saved"] = dict(w.iter_hf_state())
                res["metrics"].append(w.train_step(batch))
        elif tag == "tp2ep2_dist":                                   # resume the DP4 x EP2 checkpoint here
            w.load_checkpoint(ckpt)
            res["loaded"] = dict(w.iter_hf_state())
            res["adam_steps"] = adam_step_count(w.optimizer)
            res["metrics"].append(w.train_step(batch))
        else:
            res["metrics"].append(w.train_step(batch))
        res["weights"] = dict(w.iter_hf_state())
        res["opt_bytes"], res["expert_opt_bytes"] = _optimizer_bytes(w), _optimizer_bytes(w, experts=True)
        torch.save(res, f"{out_dir}/{tag}.rank{rank}.pt")
        w.shutdown()


@pytest.fixture(scope="module")
def moe_runs(tiny_qwen3_moe, tmp_path_factory):
    import torch.multiprocessing as mp
    tmp = tmp_path_factory.mktemp("distopt_moe")
    batch = make_batch(tiny_qwen3_moe)   # odd lengths: TP2's sequence-parallel round-up pads them
    _, lp, _ = hf_reference(tiny_qwen3_moe, batch, loss_config())
    torch.save({"batch": batch, "lp": lp}, tmp / "ref.pt")
    ports = [free_port("127.0.0.1") for _ in MOE_LAYOUTS]
    mp.spawn(_moe_child, args=(4, str(tiny_qwen3_moe), str(tmp), ports), nprocs=4, join=True)
    return {"hf_dir": tiny_qwen3_moe, "load": lambda tag, r=0: torch.load(tmp / f"{tag}.rank{r}.pt")}


@pytest.mark.slow
def test_distributed_optimizer_with_expert_parallelism_matches_replicated_adamw(moe_runs):
    """DP4 x EP2: Megatron's DDP scales expert gradients by 1/dp (not 1/edp) before summing them over the
    expert-data-parallel group and the learner multiplies its loss by dp: the AdamW path's sum over that
    group. The load-balancing loss is the mean over DP on both (aux_loss_scale 1/dp on the AdamW path)."""
    load = moe_runs["load"]
    rep, dist_ = load("ep2_adamw"), load("ep2_dist")
    _assert_close(dist_["grads"], rep["grads"], 1e-6, "dist-opt grads vs replicated (EP2)")
    assert any(".experts." in k and v.abs().max() > 0 for k, v in rep["grads"].items())
    for m_rep, m_dist in zip(rep["metrics"], dist_["metrics"]):
        assert m_rep["grad_norm"] > 0.05 and math.isclose(m_rep["grad_norm"], m_dist["grad_norm"], rel_tol=1e-4)
        assert math.isclose(m_rep["loss"], m_dist["loss"], rel_tol=1e-4, abs_tol=1e-6)
        assert math.isclose(m_rep["moe_load_balancing_loss"], m_dist["moe_load_balancing_loss"], rel_tol=1e-5)
    moved = max((rep["weights"][k] - dist_["saved"][k]).abs().max() for k in rep["weights"])
    assert moved > 1e-3
    # The critic test's tolerance: Adam divides by sqrt(v), and the clip (0.05 of norms ~3-5) brings many
    # gradients near its eps = 1e-8, where summation order over 4 ranks shows (measured: 2.7e-6 at most, an
    # o_proj element whose clipped gradient is 8e-9; 16 of 562k elements above 1e-6).
    _assert_close(dist_["weights"], rep["weights"], 1e-5, "weights after 3 steps (EP2)")


@pytest.mark.slow
def test_expert_parallel_optimizer_state_is_sharded_as_the_plan_estimates(moe_runs):
    """With the distributed optimizer the dense moments shard over dp = 4 and the experts' over their
    expert-data-parallel group (dp / ep = 2): every element's moments are held once in its group, and
    the heaviest rank holds what plan.learner_memory estimates, within 1% (Megatron's buckets end on
    dp-aligned boundaries, not at 1/dp of each parameter)."""
    from megatron_specrl.config import load_config
    from megatron_specrl.plan import build_plan
    load = moe_runs["load"]
    rep, ranks = load("ep2_adamw"), [load("ep2_dist", r) for r in range(4)]
    full, full_experts = rep["opt_bytes"], rep["expert_opt_bytes"]      # one rank's experts: 4 of the 8
    assert 0 < full_experts < full
    assert sum(r["opt_bytes"] - r["expert_opt_bytes"] for r in ranks) == full - full_experts
    assert sum(r["expert_opt_bytes"] for r in ranks) == 2 * full_experts
    cfg = load_config(None, [f"model.path={moe_runs['hf_dir']}", "learner.dp=4", "learner.ep=2",
                             "learner.distributed_optimizer=true", "learner.micro_batch_size=1",
                             "trainer.prompts_per_step=1", "rollout.n_samples=4", "data.max_prompt_len=4",
                             "rollout.max_new_tokens=8"])
    est = build_plan(cfg, check_data=False).learner.optimizer
    assert abs(max(r["opt_bytes"] for r in ranks) / est - 1) <= 0.01, ([r["opt_bytes"] for r in ranks], est)


@pytest.mark.slow
def test_expert_parallel_checkpoint_resumes_at_tp2(moe_runs):
    """The DP4 x EP2 checkpoint loads at TP2 x DP2 x EP2 (each expert split over expert TP): its weights and
    Adam's step exactly, and the resumed step is the uninterrupted third."""
    load = moe_runs["load"]
    dist_, other = load("ep2_dist"), load("tp2ep2_dist")
    assert set(other["loaded"]) == set(dist_["saved"])
    assert all(torch.equal(other["loaded"][k], dist_["saved"][k]) for k in dist_["saved"])
    assert other["adam_steps"] == STEPS - 1
    _assert_close(other["weights"], dist_["weights"], 2e-6, "TP2 x EP2 resumed step")
    assert math.isclose(other["metrics"][0]["grad_norm"], dist_["metrics"][-1]["grad_norm"], rel_tol=1e-4)


@pytest.mark.slow
def test_bf16_distributed_optimizer_with_expert_parallelism_trains(moe_runs):
    """bf16 + distributed optimizer + EP2, the recipe's combination: a step with a finite loss and grad norm."""
    m = moe_runs["load"]("ep2_bf16")["metrics"][0]
    assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
    assert math.isfinite(m["moe_load_balancing_loss"])
