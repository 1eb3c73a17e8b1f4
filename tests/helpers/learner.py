"""The learner's reference batch, the HF computation of the same objective, and the spawned-layout driver that checks Megatron layouts against it."""

from __future__ import annotations

import torch
from megatron_specrl.ports import free_port


B, T = 4, 12


TOL = 1e-5


def make_batch(hf_dir, seed: int = 0) -> dict:
    """Right-padded batch with ragged lengths, random advantages and perturbed old log-probs."""
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(str(hf_dir))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, cfg.vocab_size, (B, T), generator=g)
    lengths = torch.tensor([T, T - 3, T - 1, T - 5])
    am = (torch.arange(T)[None] < lengths[:, None]).long()
    ids = torch.where(am.bool(), ids, torch.full_like(ids, cfg.pad_token_id))
    loss_mask = am.float().clone()
    loss_mask[:, :4] = 0
    return {
        "input_ids": ids, "attention_mask": am, "loss_mask": loss_mask,
        "advantages": torch.randn(B, 1, generator=g).expand(B, T).contiguous() * loss_mask,
        "noise": 0.3 * torch.randn(B, T, generator=g),
        "ref_noise": 0.2 * torch.randn(B, T, generator=g),
    }


def hf_reference(hf_dir, batch, loss_cfg, device="cpu"):
    """HF logits, log-probs and grads (HF names) of the same RL objective, computed on `device`
    (tools/gpu_check.py: the GPU) and returned on the CPU."""
    from transformers import AutoModelForCausalLM
    from megatron_specrl.learner.losses import rl_policy_objective
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).to(device)
    batch = {k: v.to(device) for k, v in batch.items()}
    logits = model(batch["input_ids"]).logits
    logp = torch.log_softmax(logits.float(), -1)
    lp = logp[:, :-1].gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    ent = -(logp.exp() * logp).sum(-1)[:, :-1]
    z = lp.new_zeros(B, 1)
    lp, ent = torch.cat([z, lp], 1), torch.cat([z, ent], 1)
    full = complete_batch(batch, lp.detach())
    loss, _ = rl_policy_objective(lp, ent, full, loss_cfg)
    loss.backward()
    grads = {n: p.grad.cpu() for n, p in model.named_parameters()}
    return logits.detach().cpu(), (lp.detach() * batch["attention_mask"]).cpu(), grads


def complete_batch(batch, logprobs):
    out = {k: v for k, v in batch.items() if k not in ("noise", "ref_noise")}
    m = batch["attention_mask"].float()
    out["rollout_logprobs"] = (logprobs + batch["noise"]) * m
    out["old_logprobs"] = out["rollout_logprobs"]
    out["ref_logprobs"] = (logprobs + batch["ref_noise"]) * m
    return out


def loss_config():
    from megatron_specrl.config import LossConfig
    return LossConfig(clip_low=0.2, clip_high=0.28, dual_clip_c=3.0, kl_coef=0.1, kl_type="low_var_kl",
                      entropy_coef=0.01, tis="off", agg_mode="token-mean")


def _child(rank, world, layouts, hf_dir, out_dir, ports, train_and_checkpoint=False):
    from megatron_specrl.config import LearnerConfig
    from megatron_specrl.learner.worker import LearnerWorker

    ref = torch.load(f"{out_dir}/ref.pt")
    for (tp, pp, dp, max_tokens), port in zip(layouts, ports):
        tag = f"tp{tp}pp{pp}dp{dp}"
        settings = LearnerConfig(tp=tp, pp=pp, dp=dp, micro_batch_size=1, max_tokens_per_microbatch=max_tokens,
                                 loss=loss_config())
        w = LearnerWorker(rank, world, "127.0.0.1", port, settings, seed=1)
        w.load_hf(hf_dir)
        batch = complete_batch(ref["batch"], ref["lp"])
        logits = full_logits(w, batch)
        lp = w.compute_logprobs(batch)
        w.forward_backward(batch)
        grads = dict(w.iter_hf_state(grads=True))
        weights = dict(w.iter_hf_state())
        result = {"logits": logits, "lp": lp, "grads": grads, "weights": weights}
        if train_and_checkpoint:
            result.update(_train_and_checkpoint(w, batch, hf_dir, f"{out_dir}/ckpt"))
        if rank == 0:
            torch.save(result, f"{out_dir}/{tag}.pt")
        w.shutdown()


def _train_and_checkpoint(w, batch, hf_dir, path):
    """One train_step, save; a second step; reload from HF + checkpoint; the second step must repeat."""
    first = w.train_step(batch)
    w.save_checkpoint(path)
    saved = dict(w.iter_hf_state())
    second = w.train_step(batch)
    w.load_hf(hf_dir)
    w.load_checkpoint(path)
    restored = dict(w.iter_hf_state())
    again = w.train_step(batch)
    return {"first": first, "second": second, "again": again, "saved": saved, "restored": restored}


def full_logits(w, batch):
    """Gather the vocab-parallel logits (test only) and send them to rank 0."""
    import torch.distributed as dist
    rows = list(range(batch["input_ids"].shape[0]))
    mbs = w._microbatches(batch, w._dp_rows(rows))

    def loss_fn(mb, output):
        if w.settings.tp > 1:
            parts = [torch.empty_like(output) for _ in range(w.settings.tp)]
            dist.all_gather(parts, output.contiguous(), group=w.ps.get_tensor_model_parallel_group())
            output = torch.cat(parts, -1)
        return output.sum() * 0, {"rows": mb["rows"], "logits": output.detach()}

    with torch.no_grad():
        store = w._run_schedule(mbs, loss_fn, forward_only=True)
    V = w.hf_config.vocab_size
    full = torch.zeros(B, T, V)
    if w.last_stage and w.tp_rank == 0:
        for d in store:
            full[d["rows"], : d["logits"].shape[1]] = d["logits"][..., :V]
    dist.reduce(full, dst=0)
    return full if w.rank == 0 else None


def _run(hf_dir, tmp_path, world, layouts, train_and_checkpoint=False):
    import torch.multiprocessing as mp
    batch = make_batch(hf_dir)
    logits, lp, grads = hf_reference(hf_dir, batch, loss_config())
    torch.save({"batch": batch, "lp": lp}, tmp_path / "ref.pt")
    ports = [free_port("127.0.0.1") for _ in layouts]
    mp.spawn(_child, args=(world, layouts, str(hf_dir), str(tmp_path), ports, train_and_checkpoint),
             nprocs=world, join=True)
    am = batch["attention_mask"].bool()
    results = {}
    for tp, pp, dp, _ in layouts:
        r = torch.load(tmp_path / f"tp{tp}pp{pp}dp{dp}.pt")
        tag = f"tp{tp}pp{pp}dp{dp}"
        assert (r["logits"][am] - logits[am]).abs().max() <= TOL, tag
        assert (r["lp"] - lp).abs().max() <= TOL, tag
        assert set(r["grads"]) == set(grads), tag
        for n, g in grads.items():
            assert torch.allclose(r["grads"][n], g, atol=TOL, rtol=1e-4), (tag, n, (r["grads"][n] - g).abs().max())
        results[tag] = r
    return results


