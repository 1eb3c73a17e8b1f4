"""The learner side of a sync, running inside each learner rank's Ray actor.

The learner only knows how to yield its weights as full HF tensors (`iter_hf_state`); turning
them into buckets and moving them by a transport is resync's business, so it lives here and the
actor class is injected into `LearnerGroup` (cluster/actors.py) instead of the learner importing resync.
Every rank runs the sync methods (the gather is collective); only rank 0 sends. `dtype` is the
engines' (rollout.engine_dtype): floating tensors are cast to it on rank 0 as they enter a bucket,
so every transport moves the same, cast, buckets.
"""

from __future__ import annotations

import ray

from megatron_specrl.learner import worker as learner_worker
from megatron_specrl.learner.worker import LearnerWorker
from megatron_specrl.resync.buckets import plan_buckets, wire_dtype
from megatron_specrl.resync.engine_actor import load_ipc
from megatron_specrl.resync.group import ResyncMember
from megatron_specrl.resync.routes import wait_all
from megatron_specrl.resync.streams import broadcast_all, drain, push_ipc


class RayLearnerWorker(LearnerWorker, ResyncMember):
    """LearnerWorker plus its weights as resync buckets, for each transport (resync.routes).

    Every rank gives its cached GPU blocks back when its part of a sync is done (gathered shards, the
    buckets copied to the GPU): colocated, the engines take their KV cache back right after the load
    (resync.lifecycle), and memory this process keeps reserved is not theirs to map."""

    def _buckets(self, bucket_bytes: int, dtype: str, miswire: dict[str, str] | None):
        """`miswire`: check-resync's injected wrong mapping (learner.hf_mapping.MISWIRINGS); None in a run."""
        # cast where the shards live (iter_hf_state), then plan_buckets' cast is a no-op
        return plan_buckets(self.iter_hf_state(miswire=miswire, dtype=wire_dtype(dtype)), bucket_bytes,
                            dtype=dtype)

    def hf_bucket_stream(self, bucket_bytes: int, dtype: str = "float32", miswire: dict | None = None):
        """Object store: numpy payloads that Ray writes once into its store and engine actors read from there."""
        for bucket in self._buckets(bucket_bytes, dtype, miswire):
            yield bucket.to_payload()
        learner_worker.release_cached_gpu_memory()

    def open_resync_store(self, timeout_s: float) -> tuple[str, int]:
        return self.resync_endpoint.open_store(ray.util.get_node_ip_address(), timeout_s)

    def broadcast_buckets(self, bucket_bytes: int, dtype: str = "float32", miswire: dict | None = None):
        """Broadcast: rank 0 sends every bucket over the resync group; returns {buckets, bytes} there."""
        buckets = self._buckets(bucket_bytes, dtype, miswire)
        try:
            if self.rank != 0:
                return drain(buckets)
            return broadcast_all(self.resync_endpoint, buckets)
        finally:
            learner_worker.release_cached_gpu_memory()

    def push_ipc_buckets(self, bucket_bytes: int, engine_actors: list, version: int, timeout_s: float,
                         dtype: str = "float32", miswire: dict | None = None):
        """CUDA IPC: rank 0 hands each bucket's handles to every engine actor and waits for all of them."""
        buckets = self._buckets(bucket_bytes, dtype, miswire)
        if self.rank != 0:
            try:
                return drain(buckets)
            finally:
                learner_worker.release_cached_gpu_memory()

        def load_everywhere(payload):
            # Every engine must be done with the bucket before push_ipc frees it, also when one
            # fails at once: a plain ray.get raises then while another still reads (or has yet to
            # open) the handles, and freed memory is reused for the next allocation.
            refs = [a.__ray_call__.remote(load_ipc, payload, version) for a in engine_actors]
            wait_all({ref: (f"engine actor {i}", ray.get) for i, ref in enumerate(refs)}, timeout_s,
                     f"resync cuda_ipc of version {version}")
        try:
            return push_ipc(buckets, self.device, load_everywhere)
        finally:
            learner_worker.release_cached_gpu_memory()   # the last bucket's copy is still cached here

