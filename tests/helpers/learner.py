"""The learner's reference batch, the HF computation of the same objective, and the spawned-layout driver that checks Megatron layouts against it."""

from __future__ import annotations

import torch
from megatron_specrl.learner.ports import free_port


# The reference batch and HF's computation of the objective live in the package, where
# `megatron-specrl doctor` runs them against the learner on a GPU (diagnostics/reference.py).
from megatron_specrl.diagnostics.reference import B, T, complete_batch, hf_reference, loss_config, make_batch  # noqa: F401

TOL = 1e-5


def one_rank_state():
    """A learner rank of a world of one as its checkpoint I/O sees it, without a model (for the RNG state)."""
    from megatron_specrl.learner.checkpoint_io import LearnerState
    return LearnerState(rank=0, world_size=1, tp=1, pp=1, dp=1, tp_rank=0, pp_rank=0, dp_rank=0, role="policy",
                        bf16=False)


def _child(rank, world, jobs, then=None):
    """Every model's layouts in this one process (`jobs`: (layouts, hf_dir, out_dir, ports, train_and_checkpoint)
    each), then `then` = (function, args) if given, called as function(rank, world, *args): the spawn and the
    imports, most of a layout test's cost, are paid once for all of them."""
    for job in jobs:
        _layouts_of_one_model(rank, world, *job)
    if then is not None:
        then[0](rank, world, *then[1])


def _layouts_of_one_model(rank, world, layouts, hf_dir, out_dir, ports, train_and_checkpoint=False):
    from megatron_specrl.config import LearnerConfig
    from megatron_specrl.learner.worker import LearnerWorker

    ref = torch.load(f"{out_dir}/ref.pt")
    for layout, port in zip(layouts, ports):
        tp, pp, dp, max_tokens, ep = (*layout, 1)[:5]
        tag = layout_tag(layout)
        settings = LearnerConfig(tp=tp, pp=pp, dp=dp, ep=ep, micro_batch_size=1, max_tokens_per_microbatch=max_tokens,
                                 loss=loss_config())
        w = LearnerWorker(rank, world, "127.0.0.1", port, settings, seed=1)
        w.load_hf(hf_dir)
        batch = complete_batch(ref["batch"], ref["lp"])
        routing = RoutingCapture(w) if w.model.config.num_moe_experts and tp == 1 else None
        logits = full_logits(w, batch)
        if routing is not None:
            torch.save(routing.done(), f"{out_dir}/{tag}-routing-rank{rank}.pt")
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


class RoutingCapture:
    """The experts each MoE router picks for every token of the rows this rank scores, from forward hooks
    on Megatron's routers: {global layer: {batch row: bool [tokens, experts]}} (TP 1: a router then sees
    whole sequences)."""

    def __init__(self, w):
        self.picked: dict[int, dict[int, torch.Tensor]] = {}
        self.calls: dict[int, int] = {}
        self.hooks = [m.register_forward_hook(self._hook(m)) for n, m in w.model.named_modules()
                      if n.endswith("mlp.router")]
        self._wrap_microbatches(w)

    def _wrap_microbatches(self, w):
        orig = w._microbatches

        def microbatches(batch, rows):
            mbs = orig(batch, rows)
            self.rows_of = [mb["rows"].tolist() for mb in mbs]
            return mbs
        w._microbatches = microbatches
        self.restore = lambda: setattr(w, "_microbatches", orig)

    def _hook(self, router):
        def hook(_module, inputs, output):
            S, Bm = inputs[0].shape[:2]
            layer = router.layer_number - 1
            seen = self.picked.setdefault(layer, {})
            self.calls[layer] = self.calls.get(layer, 0) + 1     # one call per microbatch, in order
            rows = self.rows_of[self.calls[layer] - 1]
            picked = output[1].reshape(S, Bm, -1).transpose(0, 1).detach().cpu()
            for b, r in enumerate(rows):
                seen[r] = picked[b]
        return hook

    def done(self):
        for h in self.hooks:
            h.remove()
        self.restore()
        return self.picked


def hf_routing(hf_dir, batch) -> dict[int, torch.Tensor]:
    """HF transformers' picks: {layer: bool [B, T, experts]} from hooks on each layer's mlp.gate."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    B, T = batch["input_ids"].shape
    out = {}

    def hook(i):
        def fn(_m, _inputs, output):
            idx = output[2].reshape(B, T, -1)
            out[i] = torch.zeros(B, T, model.config.num_experts, dtype=torch.bool).scatter_(2, idx, True)
        return fn
    hooks = [layer.mlp.gate.register_forward_hook(hook(i)) for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(batch["input_ids"])
    for h in hooks:
        h.remove()
    return out


def layout_tag(layout) -> str:
    """(tp, pp, dp, max_tokens[, ep]) -> "tp2pp1dp2" (+ "ep2" when the experts are split)."""
    tp, pp, dp, _, ep = (*layout, 1)[:5]
    return f"tp{tp}pp{pp}dp{dp}" + (f"ep{ep}" if ep > 1 else "")


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
    """One model's layouts in `world` spawned processes, each checked against HF (run_models)."""
    return run_models(world, {"model": (hf_dir, tmp_path, layouts, train_and_checkpoint)})["model"]


def run_models(world, models: dict, then=None) -> dict:
    """Several models' layouts in one spawn of `world` processes: {name: (hf_dir, out_dir, layouts,
    train_and_checkpoint)} -> {name: {layout tag: result}}, every layout's logits, log-probs and gradients
    checked against HF transformers' within TOL (a failure names the layout). `then`: (function, args) each
    rank runs after them, in the same processes (a module-level function, as spawn pickles it)."""
    import torch.multiprocessing as mp
    jobs, refs = [], {}
    for name, (hf_dir, out_dir, layouts, train_and_checkpoint) in models.items():
        batch = make_batch(hf_dir)
        refs[name] = (batch, *hf_reference(hf_dir, batch, loss_config()))
        torch.save({"batch": batch, "lp": refs[name][2]}, out_dir / "ref.pt")
        jobs.append((layouts, str(hf_dir), str(out_dir), [free_port("127.0.0.1") for _ in layouts],
                     train_and_checkpoint))
    mp.spawn(_child, args=(world, jobs, then), nprocs=world, join=True)
    out = {}
    for name, (hf_dir, out_dir, layouts, _) in models.items():
        batch, logits, lp, grads = refs[name]
        am = batch["attention_mask"].bool()
        results = out[name] = {}
        for layout in layouts:
            tag = layout_tag(layout)
            r = torch.load(out_dir / f"{tag}.pt")
            assert (r["logits"][am] - logits[am]).abs().max() <= TOL, (name, tag)
            assert (r["lp"] - lp).abs().max() <= TOL, (name, tag)
            assert set(r["grads"]) == set(grads), (name, tag)
            for n, g in grads.items():
                assert torch.allclose(r["grads"][n], g, atol=TOL, rtol=1e-4), (name, tag, n, (r["grads"][n] - g).abs().max())
            results[tag] = r
    return out
