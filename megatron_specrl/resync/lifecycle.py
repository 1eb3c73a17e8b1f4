"""One weight resync: learner shards -> full HF tensors -> buckets -> engines -> new version.

Order on every sync (nothing is served between load and reset):
  1. the learner ranks gather their shards collectively; rank 0 casts to the engines' dtype and packs buckets
  2. each bucket goes to every engine as soon as it exists, by the run's transport (resync.routes:
     object store, broadcast group or CUDA IPC; with the object store the measured peak extra
     private memory is about one bucket plus the largest tensor on the learner)
  3. finish_update(version): the engine bumps weight_version and resets its prefix
     cache, then serves again. Requests sent under the old version are refused.
Generation is paused by construction: the loop is synchronous, and an engine with
a half-loaded update refuses requests until finish_update.

Colocated engines on GPUs sleep while the learner trains: `release_engine_memory` before the
learner's step, and `sync_weights(wake_engines=True)` takes the memory back around the load.
"""

from __future__ import annotations

import time

from megatron_specrl.engines.protocol import engines_behind
from megatron_specrl.resync.routes import ObjectStoreRoute


def engines_of(engine) -> list:
    """The Ray engine handles behind a router (or the engine itself)."""
    return engines_behind(engine)


def release_engine_memory(engine) -> None:
    """Colocated engines hand their GPU memory (weights and KV cache) to the learner for its step;
    sync_weights(wake_engines=True) resumes them."""
    for e in engines_of(engine):
        e.release_memory()


def sync_weights(learner, engine, version: int, bucket_bytes: int, wake_engines: bool = False,
                 route=None, dtype: str = "float32", miswire: dict | None = None) -> dict[str, float]:
    """wake_engines: colocated engines slept through training; weights come back first, KV cache last.
    route: a resync.routes route (kept by the run: the broadcast one holds its group); None = object store.
    dtype: the engines' (rollout.engine_dtype); buckets carry floating tensors in it.
    miswire: check-resync's injected wrong mapping (learner.hf_mapping.MISWIRINGS); None in a run."""
    t0 = time.perf_counter()
    targets = engines_of(engine)
    if wake_engines:
        for e in targets:
            e.resume_memory(["weights"])
    n_buckets = (route or ObjectStoreRoute()).load(learner, targets, version, bucket_bytes, dtype=dtype,
                                                   miswire=miswire)
    t_load = time.perf_counter() - t0
    for e in targets:
        e.finish_update(version)
        if wake_engines:
            e.resume_memory(["kv_cache"])
    return {"resync/seconds": time.perf_counter() - t0, "resync/load_s": t_load,
            "resync/buckets": float(n_buckets), "resync/version": float(version)}
