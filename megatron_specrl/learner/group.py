"""Driver-side handle on the learner ranks: one Ray actor per rank, all called in lockstep.

Megatron's collectives need every rank inside the same call, so each method is
sent to all actors at once and rank 0's answer is returned. The batch is put
into the object store once and shared by all ranks.
"""

from __future__ import annotations

import ray

from megatron_specrl.config import LearnerConfig
from megatron_specrl.learner.worker import LearnerWorker
from megatron_specrl.ports import free_port
from megatron_specrl.resync.buckets import plan_buckets
from megatron_specrl.resync.group import ResyncMember


class RayLearnerWorker(LearnerWorker, ResyncMember):
    """LearnerWorker plus its weights as resync buckets, for each transport (resync.routes).
    Every rank runs the sync methods (the gather is collective); only rank 0 sends.
    `dtype` is the engines' (rollout.engine_dtype): floating tensors are cast to it on rank 0 as
    they enter a bucket, so every transport moves the same, cast, buckets."""

    def _buckets(self, bucket_bytes: int, dtype: str, swap_kv: bool, swap_gate_up: bool):
        return plan_buckets(self.iter_hf_state(swap_kv=swap_kv, swap_gate_up=swap_gate_up), bucket_bytes,
                            dtype=dtype)

    def hf_bucket_stream(self, bucket_bytes: int, dtype: str = "float32", swap_kv: bool = False,
                         swap_gate_up: bool = False):
        """Object store: numpy payloads that Ray writes once into its store and engine actors read from there."""
        for bucket in self._buckets(bucket_bytes, dtype, swap_kv, swap_gate_up):
            yield bucket.to_payload()

    def open_resync_store(self, timeout_s: float) -> tuple[str, int]:
        return self.resync_endpoint.open_store(ray.util.get_node_ip_address(), timeout_s)

    def broadcast_buckets(self, bucket_bytes: int, dtype: str = "float32", swap_kv: bool = False,
                          swap_gate_up: bool = False):
        """Broadcast: rank 0 sends every bucket over the resync group; returns {buckets, bytes} there."""
        from megatron_specrl.resync.streams import drain, broadcast_all
        buckets = self._buckets(bucket_bytes, dtype, swap_kv, swap_gate_up)
        if self.rank != 0:
            return drain(buckets)
        return broadcast_all(self.resync_endpoint, buckets)

    def push_ipc_buckets(self, bucket_bytes: int, engine_actors: list, version: int, timeout_s: float,
                         dtype: str = "float32", swap_kv: bool = False, swap_gate_up: bool = False):
        """CUDA IPC: rank 0 hands each bucket's handles to every engine actor and waits for all of them."""
        from megatron_specrl.resync.streams import drain, push_ipc
        buckets = self._buckets(bucket_bytes, dtype, swap_kv, swap_gate_up)
        if self.rank != 0:
            return drain(buckets)

        def load_everywhere(payload):
            ray.get([a.update_weights_ipc.remote(payload, version) for a in engine_actors], timeout=timeout_s)
        return push_ipc(buckets, self.device, load_everywhere)


class LearnerGroup:
    def __init__(self, settings: LearnerConfig, seed: int, role: str = "policy",
                 num_cpus_per_rank: float = 0.01, num_gpus_per_rank: float = 0.0, env: dict | None = None):
        world = settings.tp * settings.pp * settings.dp
        # Idle learner threads must not spin on the cores the engine is decoding on (OpenMP's
        # default wait policy busy-waits after every parallel region).
        env = {"OMP_WAIT_POLICY": "PASSIVE", **(env or {})}
        actor_cls = ray.remote(RayLearnerWorker).options(
            num_cpus=num_cpus_per_rank, num_gpus=num_gpus_per_rank, runtime_env={"env_vars": env})
        addr, port = ray.util.get_node_ip_address(), free_port()
        self.actors = [actor_cls.remote(rank, world, addr, port, settings, seed=seed, role=role)
                       for rank in range(world)]

    def submit(self, method: str, *args, **kwargs) -> list:
        """Start `method` on every rank without waiting; one ref per rank, rank 0 first."""
        return [getattr(a, method).remote(*args, **kwargs) for a in self.actors]

    def call(self, method: str, *args, **kwargs):
        """Run `method` on every rank; return rank 0's result (raises the first rank failure)."""
        return ray.get(self.submit(method, *args, **kwargs))[0]

    def call_with_batch(self, method: str, batch: dict, **kwargs):
        ref = ray.put(batch)
        return self.call(method, ref, **kwargs)

    def load_hf(self, hf_dir: str) -> None:
        self.call("load_hf", str(hf_dir))

    def compute_logprobs(self, batch):
        return self.call_with_batch("compute_logprobs", batch)

    def compute_values(self, batch):
        return self.call_with_batch("compute_values", batch)

    def train_step(self, batch) -> dict[str, float]:
        return self.call_with_batch("train_step", batch)

    def save_checkpoint(self, path: str) -> None:
        self.call("save_checkpoint", str(path))

    def load_checkpoint(self, path: str) -> None:
        self.call("load_checkpoint", str(path))

    def export_hf(self, out_dir: str) -> None:
        self.call("export_hf", str(out_dir))

    def bucket_streams(self, bucket_bytes: int, dtype: str = "float32", **kwargs):
        """Start the collective weight gather on all ranks; returns rank 0's stream of bucket refs
        (tensors cast to `dtype`) and the other ranks' streams (drain them so their generators finish)."""
        # Backpressure: rank 0 packs at most two buckets ahead of the engines.
        streams = [a.hf_bucket_stream.options(num_returns="streaming", _generator_backpressure_num_objects=2)
                   .remote(bucket_bytes, dtype, **kwargs) for a in self.actors]
        return streams[0], streams[1:]

    def shutdown(self) -> None:
        for a in self.actors:
            try:
                ray.get(a.shutdown.remote(), timeout=30)
            except Exception:
                pass
            ray.kill(a)
