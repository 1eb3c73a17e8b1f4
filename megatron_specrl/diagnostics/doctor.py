"""`megatron-specrl doctor`: is this machine's install able to run the project, and do the learner's
CUDA code paths agree with HF transformers? Without Ray or an engine.

First the stack check every node of a `launch` job runs (megatron_specrl.cluster.gpu_stack: torch,
megatron-core, vLLM or SGLang, Ray, transformers and, on GPU nodes, transformer-engine import; on GPU
nodes also their pinned versions and the GPU count). Then the smoke checks, on one GPU, or for every
check that can run there, on this CPU over gloo; a check that needs CUDA is reported as skipped, with
the reason. One JSON record per check is written to --out, so a short lease on a GPU machine answers
what the CPU suite cannot:

- `learner_fp32`: Megatron-core on CUDA (NCCL, the real CUDA code paths that the CPU shims replace):
  log-probs and gradients of the RL objective against HF transformers on the same device.
- `recompute`: `learner.recompute=selective|full` (CUDA only) give the same log-probs and gradients.
- `optimizers`: three train steps with torch AdamW and with Megatron's DDP + distributed optimizer.
- `checkpoint`: a distributed-optimizer checkpoint saved after step 2 and resumed in a new learner
  repeats step 3.
- `bf16`: `learner.precision=bfloat16` (Float16Module, fp32 main grads, distributed optimizer):
  log-probs against the fp32 learner's, three train steps, the resync gather's dtype.
- `cuda_ipc`: the learner's buckets (`push_ipc`) mapped in place by a second process through the
  engine-side loader (`reload_ipc_in_worker`), every tensor compared; a wrong-GPU handle is refused;
  bandwidth of one large bucket (CUDA only).
- `throughput`: a ~0.5B Llama-shaped model (the tiny one on CPU, or with --small): fp32 (with and
  without TF32), bf16, bf16 with full recompute: train steps (tokens/s), scoring, peak memory,
  log-probs against fp32's.

    megatron-specrl doctor [--out doctor.json] [--only stack,learner_fp32,cuda_ipc] [--small] [--gpus N]

Exit status: 0 when every check passed or was skipped, 1 when one failed, 4 when the stack check failed
(the smoke checks do not run then).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from megatron_specrl.diagnostics.reference import complete_batch, hf_reference, loss_config, make_batch
from megatron_specrl.errors import first_sentence
from megatron_specrl.learner.ports import free_port
CUDA = torch.cuda.is_available()
DEV = torch.device("cuda", 0) if CUDA else torch.device("cpu")


def _settings(**kw):
    from megatron_specrl.config import LearnerConfig
    base = dict(tp=1, pp=1, dp=1, micro_batch_size=2, loss=loss_config(), lr=1e-3, grad_clip=1.0)
    base.update(kw)
    return LearnerConfig(**base)


def _worker(settings, hf_dir):
    from megatron_specrl.learner.worker import LearnerWorker
    w = LearnerWorker(0, 1, "127.0.0.1", free_port(), settings, seed=1)
    w.load_hf(hf_dir)
    return w


def _maxdiff(a: dict, b: dict) -> float:
    return max(float((a[k].float().cpu() - b[k].float().cpu()).abs().max()) for k in a)


def _batch(hf_dir):
    """make_batch's batch completed with HF's log-probs (rollout / old / reference)."""
    batch = make_batch(hf_dir)
    return complete_batch(batch, hf_reference(hf_dir, batch, loss_config())[1])


def check_learner_fp32(hf_dir):
    batch = make_batch(hf_dir)
    _, hf_lp, hf_grads = hf_reference(hf_dir, batch, loss_config(), device=DEV)   # HF on the same device
    full = complete_batch(batch, hf_lp)
    w = _worker(_settings(), hf_dir)
    try:
        lp = w.compute_logprobs(full)
        w.forward_backward(full)
        grads = dict(w.iter_hf_state(grads=True))
        on = {str(p.device) for p in w.model.parameters()}
        m = full["attention_mask"].bool()
        return {"param_devices": sorted(on), "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
                "logprob_maxdiff_vs_hf": float((lp.cpu() - hf_lp)[m].abs().max()),
                "grad_maxdiff_vs_hf": _maxdiff(grads, hf_grads),
                "grad_maxabs": max(float(g.abs().max()) for g in hf_grads.values()),
                "ok": float((lp.cpu() - hf_lp)[m].abs().max()) < 1e-4}
    finally:
        w.shutdown()


def check_recompute(hf_dir):
    if not CUDA:
        return {"skipped": "learner.recompute=selective|full needs CUDA; torch sees no GPU"}
    full = _batch(hf_dir)
    out, ref = {}, None
    for mode in ("none", "selective", "full"):
        w = _worker(_settings(recompute=mode), hf_dir)
        try:
            lp = w.compute_logprobs(full).cpu()
            w.forward_backward(full)
            grads = dict(w.iter_hf_state(grads=True))
        finally:
            w.shutdown()
        if ref is None:
            ref = (lp, grads)
        else:
            out[mode] = {"logprob_maxdiff": float((lp - ref[0]).abs().max()), "grad_maxdiff": _maxdiff(grads, ref[1])}
    out["ok"] = all(v["grad_maxdiff"] < 1e-5 for v in out.values() if isinstance(v, dict))
    return out


def _train(settings, hf_dir, full, steps=3, save_at=None, ckpt=None):
    w = _worker(settings, hf_dir)
    try:
        metrics = []
        for i in range(steps):
            if save_at is not None and i == save_at:
                w.save_checkpoint(ckpt)
            metrics.append(w.train_step(full))
        return metrics, {k: v.cpu() for k, v in w.iter_hf_state()}
    finally:
        w.shutdown()


def check_optimizers(hf_dir):
    full = _batch(hf_dir)
    m_adamw, w_adamw = _train(_settings(), hf_dir, full)
    m_dist, w_dist = _train(_settings(distributed_optimizer=True), hf_dir, full)
    d = _maxdiff(w_adamw, w_dist)
    return {"adamw_loss": [m["loss"] for m in m_adamw], "dist_loss": [m["loss"] for m in m_dist],
            "grad_norm": [(a["grad_norm"], b["grad_norm"]) for a, b in zip(m_adamw, m_dist)],
            "weights_maxdiff": d, "ok": d < 1e-5}


def check_checkpoint(hf_dir):
    full = _batch(hf_dir)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = f"{tmp}/ckpt"
        m, wts = _train(_settings(distributed_optimizer=True), hf_dir, full, steps=3, save_at=2, ckpt=ckpt)
        w = _worker(_settings(distributed_optimizer=True), hf_dir)
        try:
            w.load_checkpoint(ckpt)
            again = w.train_step(full)
            after = {k: v.cpu() for k, v in w.iter_hf_state()}
        finally:
            w.shutdown()
        files = sum(1 for _ in Path(ckpt).rglob("*") if _.is_file())
    d = _maxdiff(wts, after)
    return {"step3_loss": m[2]["loss"], "resumed_step3_loss": again["loss"], "weights_maxdiff": d,
            "files": files, "ok": d < 1e-6 and abs(m[2]["loss"] - again["loss"]) < 1e-6}


def check_bf16(hf_dir):
    full = _batch(hf_dir)
    m = full["attention_mask"].bool()
    w32 = _worker(_settings(), hf_dir)
    try:
        lp32 = w32.compute_logprobs(full).cpu()
    finally:
        w32.shutdown()
    w = _worker(_settings(precision="bfloat16", distributed_optimizer=True, recompute_old_logprobs=True), hf_dir)
    try:
        lp16 = w.compute_logprobs(full)
        dtypes = sorted({str(p.dtype) for p in w.model.parameters()})
        metrics = [w.train_step(full) for _ in range(3)]
        gathered = {str(t.dtype) for _, t in w.iter_hf_state()}
        cast = {str(t.dtype) for _, t in w.iter_hf_state(dtype=torch.bfloat16)}
    finally:
        w.shutdown()
    d = float((lp16.cpu() - lp32)[m].abs().max())
    finite = all(math.isfinite(x["loss"]) and math.isfinite(x["grad_norm"]) for x in metrics)
    return {"param_dtypes": dtypes, "logprob_dtype": str(lp16.dtype), "logprob_maxdiff_vs_fp32": d,
            "losses": [x["loss"] for x in metrics], "grad_norms": [x["grad_norm"] for x in metrics],
            "gathered_dtypes": sorted(gathered), "cast_dtypes": sorted(cast), "ok": finite and d < 0.2}


class _FakeVllmWorker:
    """What reload_ipc_in_worker needs of a vLLM worker: a device and reload_weights(weights_iterator)."""

    def __init__(self, device):
        self.device = device
        self.sums: dict[str, tuple] = {}

    def reload_weights(self, weights_iterator):
        for name, t in weights_iterator:
            copy = t.clone()        # vLLM copies into its own parameters; the handle's memory is the learner's
            self.sums[name] = (str(t.device), str(t.dtype), list(t.shape), float(copy.double().sum()),
                               float(copy.double().abs().sum()))


def _ipc_receiver(inbox, outbox):
    """Engine-side process: open each payload's handles, load, reply with what arrived."""
    from megatron_specrl.resync.engine_actor import reload_ipc_in_worker
    torch.cuda.set_device(0)
    while True:
        payload = inbox.get()
        if payload is None:
            return
        worker = _FakeVllmWorker(torch.device("cuda", 0))
        try:
            t0 = time.perf_counter()
            n = reload_ipc_in_worker(worker, payload)
            outbox.put({"n": n, "sums": worker.sums, "s": time.perf_counter() - t0})
        except Exception as e:   # noqa: BLE001 - reported to the parent
            outbox.put({"error": f"{type(e).__name__}: {e}"})


def check_cuda_ipc(hf_dir):
    if not CUDA:
        return {"skipped": "CUDA IPC needs a CUDA GPU; torch sees none"}
    import torch.multiprocessing as mp
    from megatron_specrl.resync.buckets import plan_buckets
    from megatron_specrl.resync.streams import push_ipc
    from megatron_specrl.resync.transports import CudaIpcTransport, IpcPayload
    from megatron_specrl.resync.group import ResyncTransportError

    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_ipc_receiver, args=(inbox, outbox), daemon=True)
    proc.start()
    out = {}
    try:
        replies = []

        def load_everywhere(payload):
            inbox.put(payload)
            r = outbox.get(timeout=120)
            if "error" in r:
                raise RuntimeError(r["error"])
            replies.append(r)

        w = _worker(_settings(), hf_dir)
        try:
            for dtype in ("float32", "bfloat16"):
                replies.clear()
                want = {k: v for k, v in w.iter_hf_state(dtype=getattr(torch, dtype))}
                buckets = plan_buckets(w.iter_hf_state(dtype=getattr(torch, dtype)), 64 * 1024, dtype=dtype)
                before = torch.cuda.memory_allocated()
                sent = push_ipc(buckets, w.device, load_everywhere)
                got = {k: v for r in replies for k, v in r["sums"].items()}
                bad = [k for k, t in want.items()
                       if k not in got or abs(got[k][3] - float(t.double().sum())) > 1e-6 * (1 + got[k][4])
                       or got[k][1] != str(t.dtype) or got[k][2] != list(t.shape)]
                out[dtype] = {"buckets": sent["buckets"], "bytes": sent["bytes"], "tensors": len(got),
                              "expected": len(want), "mismatched": bad[:5],
                              "receiver_devices": sorted({v[0] for v in got.values()}),
                              "alloc_growth_bytes": torch.cuda.memory_allocated() - before}
        finally:
            w.shutdown()
        # a payload naming another GPU is refused in one line, before any handle is opened
        t = CudaIpcTransport()
        from megatron_specrl.resync.buckets import Bucket
        p = t.pack(Bucket.from_tensors([("x", torch.ones(4, device=DEV))]))
        try:
            CudaIpcTransport().unpack(IpcPayload(p.metas_json, p.handles, "GPU-00000000-wrong"))
            out["wrong_gpu"] = "accepted"
        except ResyncTransportError as e:
            out["wrong_gpu"] = first_sentence(str(e), 160)   # megatron_specrl/errors.py: never mid-word
        t.release()
        # bandwidth: one 1 GiB bf16 bucket, mapped and copied by the receiver (vLLM's in-place load)
        big = torch.randn(512 * 1024 * 1024, device=DEV, dtype=torch.bfloat16)
        bucket = Bucket.from_tensors([("model.layers.0.mlp.big", big)])
        replies.clear()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        CudaIpcTransport().push(bucket, load_everywhere)
        wall = time.perf_counter() - t0
        out["bucket_1gib"] = {"push_s": wall, "receiver_s": replies[0]["s"], "GBps": bucket.nbytes / wall / 1e9,
                              "sum_match": abs(replies[0]["sums"]["model.layers.0.mlp.big"][3]
                                               - float(big.double().sum())) < 1e-3 * (1 + replies[0]["sums"]["model.layers.0.mlp.big"][4] * 1e-6)}
        del big, bucket
        out["ok"] = all(not out[d]["mismatched"] and out[d]["tensors"] == out[d]["expected"]
                        for d in ("float32", "bfloat16")) and out["wrong_gpu"] != "accepted"
    finally:
        inbox.put(None)
        proc.join(30)
    return out


def _llama_dir(out: Path, hidden, layers, heads, kv, inter, vocab) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM
    from megatron_specrl.models.tiny import build_tokenizer
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    with torch.device(DEV):
        model = LlamaForCausalLM(cfg)
    model.save_pretrained(str(out), safe_serialization=True)
    del model
    return out


def check_throughput(hf_dir, big: bool = True):
    """fp32 vs bf16 train steps of a ~0.5B model (B sequences x T tokens), after one warm-up step."""
    B, T = (8, 1024) if big else (4, 64)
    shape = dict(hidden=2048, layers=8, heads=16, kv=8, inter=5632, vocab=32000) if big else \
        dict(hidden=128, layers=2, heads=4, kv=2, inter=256, vocab=264)
    with tempfile.TemporaryDirectory() as tmp:
        d = _llama_dir(Path(tmp) / "m", **shape)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, shape["vocab"], (B, T), generator=g)
        am = torch.ones(B, T, dtype=torch.long)
        lm = am.float().clone()
        lm[:, : T // 4] = 0
        batch = {"input_ids": ids, "attention_mask": am, "loss_mask": lm,
                 "advantages": torch.randn(B, 1, generator=g).expand(B, T).contiguous() * lm,
                 "rollout_logprobs": torch.zeros(B, T), "ref_logprobs": torch.zeros(B, T)}
        out = {"shape": shape, "B": B, "T": T}
        bf16 = dict(precision="bfloat16", distributed_optimizer=True, recompute_old_logprobs=True)
        variants = (("fp32", {}, False), ("fp32_tf32", {}, True), ("bf16", bf16, False),
                    ("bf16_recompute_selective", dict(bf16, recompute="selective") if CUDA else bf16, False),
                    ("bf16_recompute_full", dict(bf16, recompute="full") if CUDA else bf16, False))
        gib = (lambda: torch.cuda.max_memory_allocated() / 2**30) if CUDA else (lambda: None)
        reset = torch.cuda.reset_peak_memory_stats if CUDA else (lambda: None)
        ref_lp = None
        for tag, kw, tf32 in variants:
            torch.backends.cuda.matmul.allow_tf32 = tf32
            torch.backends.cudnn.allow_tf32 = tf32
            reset()
            w = _worker(_settings(micro_batch_size=2, **kw), d)
            try:
                peak_load = gib()
                reset()
                w.compute_logprobs(batch)
                sync = torch.cuda.synchronize if CUDA else (lambda: None)
                sync()
                t0 = time.perf_counter()
                lp = w.compute_logprobs(batch).cpu()
                sync()
                score = time.perf_counter() - t0
                ref_lp = lp if ref_lp is None else ref_lp
                peak_score = gib()
                batch["old_logprobs"] = torch.zeros(B, T)
                w.train_step(batch)              # the optimizer's state exists from here on
                sync()
                reset()
                w.forward_backward(batch)        # forward + backward alone, no optimizer step
                sync()
                peak_fwd_bwd = gib()
                reset()
                w.train_step(batch)
                sync()
                t0 = time.perf_counter()
                steps = 3
                for _ in range(steps):
                    m = w.train_step(batch)
                sync()
                dt = (time.perf_counter() - t0) / steps
                peak = gib()
                sel = lm.bool()
                out[tag] = {"train_step_s": dt, "train_tokens_per_s": B * T / dt, "score_s": score,
                            "loss": m["loss"], "peak_train_gib": peak, "peak_load_gib": peak_load,
                            "peak_score_gib": peak_score, "peak_fwd_bwd_gib": peak_fwd_bwd, "plan_gib": _plan_gib(d, B, T, kw),
                            "logprob_maxdiff_vs_fp32": float((lp - ref_lp)[sel].abs().max()),
                            "logprob_meandiff_vs_fp32": float((lp - ref_lp)[sel].abs().mean())}
            finally:
                torch.backends.cuda.matmul.allow_tf32 = False
                torch.backends.cudnn.allow_tf32 = True
                batch.pop("old_logprobs", None)
                w.shutdown()
                if CUDA:
                    torch.cuda.empty_cache()
                    if tag in out:
                        out[tag]["left_after_shutdown_gib"] = torch.cuda.memory_allocated() / 2**30
        out["bf16_speedup"] = out["fp32"]["train_step_s"] / out["bf16"]["train_step_s"]
        out["tf32_speedup"] = out["fp32"]["train_step_s"] / out["fp32_tf32"]["train_step_s"]
        out["ok"] = all(math.isfinite(out[t]["loss"]) for t, _, _ in variants)
    return out


def _plan_gib(model_dir, B, T, learner_kw) -> dict:
    """The plan check's learner memory for this run's shape (megatron_specrl.plan, unfused attention and
    torch's foreach AdamW: no TransformerEngine here), to set beside the measured peaks."""
    from megatron_specrl.config import load_config, resolve_recipe
    from megatron_specrl.learner.model_provider import padded_vocab_size
    from megatron_specrl.plan import ModelShape, learner_memory, load_hf_config
    s = ModelShape.from_hf(load_hf_config(str(model_dir)))
    ov = [f"model.path={model_dir}", f"data.max_prompt_len={T // 4}", f"rollout.max_new_tokens={T - T // 4}",
          f"trainer.prompts_per_step={B // 2}", "rollout.n_samples=2", "learner.micro_batch_size=2",
          f"rollout.max_model_len={T}"] + [f"learner.{k}={str(v).lower()}" for k, v in learner_kw.items()]
    cfg = load_config(resolve_recipe("tiny-cpu-grpo"), ov)
    m = learner_memory(cfg, s, padded_vocab_size(s.vocab, 1), flash=False, adam="foreach")
    return {"static": m.static / 2**30, "activations": m.activations / 2**30,
            "optimizer_step": m.optimizer_step / 2**30, "total": m.total / 2**30,
            "scoring": (m.static + m.scoring) / 2**30}


CHECKS = {"learner_fp32": check_learner_fp32, "recompute": check_recompute, "optimizers": check_optimizers,
          "checkpoint": check_checkpoint, "bf16": check_bf16, "cuda_ipc": check_cuda_ipc,
          "throughput": check_throughput}
ALL = ("stack", *CHECKS)


def check_stack(engine: str, gpus: int) -> dict:
    """gpu_stack.check_stack: the imports (and on GPU nodes the pins and the GPU count)."""
    from megatron_specrl.cluster.gpu_stack import check_stack as stack
    report, failures = stack(engine, gpus)
    return {"engine": engine, "gpus": gpus, "installed": report, "failures": failures, "ok": not failures,
            **({} if gpus else {"note": "--gpus 0: imports only (no pins, no transformer-engine, no CUDA)"})}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-specrl doctor", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="checks: " + ", ".join(ALL))
    p.add_argument("--out", default="doctor.json", help="the JSON record, rewritten after each check")
    p.add_argument("--only", default="", help="comma-separated checks (default: all)")
    p.add_argument("--small", action="store_true",
                   help="throughput on the tiny model (the default without CUDA)")
    p.add_argument("--gpus", type=int, default=None,
                   help="GPUs the stack check requires, with the pinned versions (default: the GPUs CUDA sees)")
    p.add_argument("--engine", choices=["vllm", "sglang"], default="vllm", help="the rollout engine's stack")
    return p


def doctor_main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(ALL)
    unknown = [n for n in names if n not in ALL]
    if unknown:
        print(f"doctor: unknown check(s) {', '.join(unknown)}; choose from {', '.join(ALL)}", file=sys.stderr)
        return 2
    gpus = args.gpus if args.gpus is not None else (torch.cuda.device_count() if CUDA else 0)
    record = {"torch": torch.__version__, "cuda": torch.version.cuda,
              "device": torch.cuda.get_device_name(0) if CUDA else "cpu"}
    try:
        import megatron.core
        record["megatron_core"] = megatron.core.__version__
    except Exception as e:  # noqa: BLE001
        record["megatron_core"] = repr(e)
    out = Path(args.out)
    print(f"doctor: torch {record['torch']}, CUDA {record['cuda'] or 'none'}, device {record['device']}, "
          f"megatron-core {record['megatron_core']}; record in {out}", flush=True)

    def report(name: str, res: dict) -> None:
        record[name] = res
        out.write_text(json.dumps(record, indent=1, default=str))
        if res.get("skipped"):
            status = f"SKIPPED ({res['skipped']})"
        else:
            status = ("ok" if res.get("ok") else "FAILED") + f" in {res.get('wall_s', 0):.1f} s"
        print(f"{name}: {status}", flush=True)
        if not res.get("skipped"):
            print("  " + json.dumps({k: v for k, v in res.items() if k not in ("ok", "wall_s")},
                                    default=str)[:1500], flush=True)

    if "stack" in names:
        t0 = time.perf_counter()
        res = check_stack(args.engine, gpus)
        res["wall_s"] = round(time.perf_counter() - t0, 2)
        report("stack", res)
        if not res["ok"]:
            print("SOME FAILED: the stack check failed, the smoke checks did not run")
            return 4
    smoke = [n for n in names if n in CHECKS]
    if smoke:
        from megatron_specrl.models.tiny import build_tiny_model
        with tempfile.TemporaryDirectory() as tmp:
            hf_dir = build_tiny_model(Path(tmp) / "tiny-llama", arch="llama", seed=0)
            for name in smoke:
                t0 = time.perf_counter()
                try:
                    res = (CHECKS[name](hf_dir, big=CUDA and not args.small) if name == "throughput"
                           else CHECKS[name](hf_dir))
                except Exception:  # noqa: BLE001 - every check reports, the next one still runs
                    res = {"ok": False, "error": traceback.format_exc()[-3000:]}
                res["wall_s"] = round(time.perf_counter() - t0, 2)
                report(name, res)
    ok = all(record[n].get("ok") or record[n].get("skipped") for n in names)
    skipped = [n for n in names if record[n].get("skipped")]
    print(("ALL OK" if ok else "SOME FAILED") + (f" ({len(skipped)} skipped: {', '.join(skipped)})" if skipped else ""))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(doctor_main(sys.argv[1:]))
