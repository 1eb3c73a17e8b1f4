"""Benchmark one weight resync (learner Ray actors -> buckets -> transport -> vLLM engine actor).

--transport ray: buckets go through Ray's object store; broadcast: over the gloo resync group
(resync.group; NCCL on GPUs). Both print the same table; the learner/engine split is object-store only.

Prints bytes moved, seconds, GB/s, the ratio to this machine's memcpy bandwidth
(measured in the same run, same byte count) and the peak extra memory: the RSS rise
over the pre-sync baseline of learner rank 0, the engine actor and this driver,
sampled every few ms with psutil while the sync runs.

The model is a randomly initialised Llama (default ~60M parameters, 240 MB fp32)
built locally with transformers (no download) and cached next to the tiny models
(built aside and renamed into place, so an interrupted build is never reused).
--engine-dtype bfloat16 serves it in bf16: the learner (fp32) casts while bucketing, so the
bytes moved halve.

    megatron-specrl bench-resync --bucket-mb 64 --repeats 3 [--transport broadcast] [--engine-dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch


BENCH_MODEL_MARKER = "bench_model.json"   # written last: the checkpoint is complete


def build_bench_model(hidden: int, layers: int, intermediate: int, vocab: int, seed: int = 0) -> Path:
    """Random Llama checkpoint + the tiny tokenizer (the engine needs one; ids stay < its length).
    Built in a temporary directory and renamed into place (models.cache.build_once, as the tiny
    models): a run killed while building leaves no directory that a later run would reuse."""
    from megatron_specrl.models.cache import build_once
    from megatron_specrl.models.resolve import cache_root

    params = {"hidden": hidden, "layers": layers, "intermediate": intermediate, "vocab": vocab, "seed": seed}
    out = cache_root() / f"bench-llama-h{hidden}-l{layers}-f{intermediate}-v{vocab}-s{seed}"
    if (out / BENCH_MODEL_MARKER).is_file():
        return out

    def build(tmp: Path) -> None:
        write_bench_model(tmp, **params)
        (tmp / BENCH_MODEL_MARKER).write_text(json.dumps(params))    # last: the checkpoint is complete

    return build_once(out, BENCH_MODEL_MARKER, build)


def write_bench_model(out: Path, hidden: int, layers: int, intermediate: int, vocab: int, seed: int = 0) -> None:
    """The checkpoint's files, written into `out`."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from megatron_specrl.models.tiny import build_tokenizer

    tok = build_tokenizer(out)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128 or 1,
                      max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                      dtype="float32")
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(str(out), safe_serialization=True)


def memcpy_gbps(nbytes: int, repeats: int = 5) -> float:
    """Best-of-n torch copy of `nbytes` (read + write of the same bytes a resync moves once)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)          # first touch of the destination pages
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    del src, dst
    return nbytes / best / 1e9


class RssPeak:
    """Peak rise of private resident memory (RSS minus shared pages, so Ray's object store, which
    is shared memory, is not counted in every process that maps it) over each process's baseline,
    sampled in a background thread."""

    def __init__(self, pids: dict[str, int], interval_s: float = 0.005):
        import psutil
        self.procs = {k: psutil.Process(p) for k, p in pids.items()}
        self.interval_s = interval_s
        self.base = self.peak = {}
        self._stop = threading.Event()

    def _rss(self) -> dict[str, int]:
        out = {}
        for k, p in self.procs.items():
            m = p.memory_info()
            out[k] = m.rss - getattr(m, "shared", 0)
        return out

    def __enter__(self):
        self.base = self._rss()
        self.peak = dict(self.base)
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(self.interval_s):
            for k, v in self._rss().items():
                self.peak[k] = max(self.peak[k], v)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        for k, v in self._rss().items():
            self.peak[k] = max(self.peak[k], v)

    def extra_mb(self) -> dict[str, float]:
        return {k: (self.peak[k] - self.base[k]) / 2**20 for k in self.procs}


def breakdown(learner, engine, version: int, bucket_bytes: int, pids, dtype: str) -> dict:
    """The same sync in two separated halves: the learner's gather + pack + object-store put
    (all buckets materialised), then the engine's read + unpack + in-place reload + cache reset."""
    import ray
    with RssPeak(pids) as m1:
        t = time.perf_counter()
        from megatron_specrl.resync.routes import bucket_streams, load_refs
        rank0, others = bucket_streams(learner, bucket_bytes, dtype)
        refs = list(rank0)
        for s in others:
            for _ in s:
                pass
        ray.wait(refs, num_returns=len(refs))
        t_learner = time.perf_counter() - t
    with RssPeak(pids) as m2:
        t = time.perf_counter()
        load_refs(engine, refs, version)
        engine.finish_update(version)
        t_engine = time.perf_counter() - t
    del refs
    return {"learner gather+pack+put": (t_learner, m1.extra_mb()),
            "engine get+unpack+reload": (t_engine, m2.extra_mb())}


def _pid(actor_self) -> int:   # runs inside a learner actor via __ray_call__
    return os.getpid()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-specrl bench-resync", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--bucket-mb", type=int, default=64)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="syncs timed (after none: the first one is reported too)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--transport", choices=["ray", "broadcast"], default="ray")
    p.add_argument("--engine-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="engine weights dtype; the sync ships buckets in it")
    p.add_argument("--verify", action="store_true", help="read the engine weights back and compare with the learner")
    p.add_argument("--json", default=None, help="also write the results here")
    return p


def bench_resync_main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    import ray
    from rich.console import Console
    from rich.table import Table

    from megatron_specrl.cluster.actors import build_actors, init_ray
    from megatron_specrl.config import LearnerConfig, RayConfig, RolloutConfig
    from megatron_specrl.learner.hf_mapping import expected_hf_shapes
    from megatron_specrl.resync.lifecycle import sync_weights
    from megatron_specrl.resync.routes import make_route

    console = Console(width=120)
    t_start = time.perf_counter()
    model_dir = build_bench_model(args.hidden, args.layers, args.intermediate, args.vocab)
    from transformers import AutoConfig
    hf_cfg = AutoConfig.from_pretrained(str(model_dir))
    itemsize = getattr(torch, args.engine_dtype).itemsize
    nbytes = sum(itemsize * torch.Size(s).numel() for s in expected_hf_shapes(hf_cfg).values())
    console.print(f"model {model_dir.name}: {nbytes / itemsize / 1e6:.1f}M parameters, {nbytes / 2**20:.0f} MiB "
                  f"{args.engine_dtype} on the wire (learner fp32); learner TP={args.tp} x PP={args.pp}; "
                  f"bucket {args.bucket_mb} MiB; transport {args.transport}")

    init_ray(RayConfig(num_cpus=2))
    actors = None
    try:
        actors = build_actors(model_dir, LearnerConfig(tp=args.tp, pp=args.pp),
                              RolloutConfig(kv_cache_gb=0.25, engine_dtype=args.engine_dtype).resolved(), seed=0,
                              log_dir=tempfile.mkdtemp(prefix="bench-resync-"))
        learner, engine = actors.learner, actors.engine
        pids = {"learner rank 0": ray.get(learner.actors[0].__ray_call__.remote(_pid)),
                "engine actor": engine.pid, "driver": os.getpid()}
        t_setup = time.perf_counter() - t_start
        mc = memcpy_gbps(nbytes)

        route = make_route(args.transport)
        if args.transport == "broadcast":   # the one-off rendezvous is not part of a sync
            t = time.perf_counter()
            route.connect(learner, [engine])
            console.print(f"broadcast group ({route.backend}) built in {time.perf_counter() - t:.2f} s")
        runs = []
        for version in range(1, args.repeats + 1):
            with RssPeak(pids) as mem:
                out = sync_weights(learner, engine, version, args.bucket_mb << 20, route=route,
                                   dtype=args.engine_dtype)
            runs.append({"seconds": out["resync/seconds"], "buckets": int(out["resync/buckets"]),
                         "gbps": nbytes / out["resync/seconds"] / 1e9, "extra_mb": mem.extra_mb()})
        split = breakdown(learner, engine, args.repeats + 1, args.bucket_mb << 20, pids, args.engine_dtype) \
            if args.transport == "ray" else {}
        mc = max(mc, memcpy_gbps(nbytes))   # measured again after the syncs: same run, warm machine

        table = Table(title=f"{args.transport} resync of {nbytes / 2**20:.0f} MiB {args.engine_dtype} (memcpy {mc:.2f} GB/s on this "
                            "machine, same run)")
        for c in ("sync", "buckets", "seconds", "GB/s", "ratio to memcpy", *(f"peak extra MiB: {k}" for k in pids)):
            table.add_column(c, justify="right")
        for i, r in enumerate(runs, 1):
            table.add_row(str(i), str(r["buckets"]), f"{r['seconds']:.2f}", f"{r['gbps']:.3f}",
                          f"{r['gbps'] / mc:.3f}", *(f"{r['extra_mb'][k]:.0f}" for k in pids))
        console.print(table)
        med = statistics.median(r["seconds"] for r in runs)
        for what, (sec, extra) in split.items():
            console.print(f"  {what}: {sec:.2f} s ({nbytes / sec / 1e9:.3f} GB/s), peak extra MiB "
                          + ", ".join(f"{k} {v:.0f}" for k, v in extra.items()))
        console.print(f"median: {nbytes / 2**20:.0f} MiB in {med:.2f} s = {nbytes / med / 1e9:.3f} GB/s "
                      f"= {nbytes / med / 1e9 / mc:.3f} x memcpy; setup {t_setup:.0f} s")

        if args.verify:
            from megatron_specrl.diagnostics.check import learner_hf_state, read_engine_weights
            from megatron_specrl.diagnostics.readout import compare_weights
            rows = compare_weights(read_engine_weights(engine)[engine.name],
                                   learner_hf_state(learner, dtype=args.engine_dtype))
            console.print(f"verify: {len(rows)} tensors, max |engine - learner| {max(r.max_abs for r in rows):.3g}")
        if args.json:
            Path(args.json).write_text(json.dumps({"transport": args.transport, "engine_dtype": args.engine_dtype,
                                                   "bytes": nbytes, "memcpy_gbps": mc,
                                                   "runs": runs}, indent=1))
        console.print(f"total wall time {time.perf_counter() - t_start:.0f} s")
        return 0
    finally:
        if actors is not None:
            actors.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(bench_resync_main(sys.argv[1:]))
