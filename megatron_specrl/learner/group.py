"""Driver-side handle on the learner ranks: one Ray actor per rank, all called in lockstep.

Megatron's collectives need every rank inside the same call, so each method is
sent to all actors at once and rank 0's answer is returned. The batch is put
into the object store once and shared by all ranks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import ray

from megatron_specrl.config import LearnerConfig
from megatron_specrl.learner.ports import free_port
from megatron_specrl.learner.worker import LearnerWorker


@ray.remote
def _rendezvous() -> tuple[str, int]:
    """The IP and a free port of the node this runs on (rank 0's bundle): torch.distributed's master."""
    return ray.util.get_node_ip_address(), free_port()


LEARNER_CPUS = "SPECRL_LEARNER_CPUS"   # CPUs the learner ranks' one OpenMP thread each may run on


def rank_env(num_gpus_per_rank: float, env: dict | None = None,
             environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The env_vars of each learner rank's actor (set before the process starts, so before CUDA
    initializes). Idle learner threads must not spin on the cores the engine is decoding on
    (OpenMP's default wait policy busy-waits after every parallel region). GPU ranks get
    CUDA_DEVICE_MAX_CONNECTIONS=1, as Megatron-LM's scripts and slime's Ray runtime env set: the TP / sequence
    parallel collectives and the overlapped grad reduce rely on one hardware queue to run in issue
    order (megatron.core.tensor_parallel.layers warns without it). A value the user set, in `env` or
    in the driver's environment (`environ`, default os.environ), is kept and passed on to the ranks."""
    environ = os.environ if environ is None else environ
    out = {"OMP_WAIT_POLICY": "PASSIVE"}
    if num_gpus_per_rank > 0:
        out["CUDA_DEVICE_MAX_CONNECTIONS"] = environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    elif environ.get(LEARNER_CPUS):   # run/overlap.split_cores: the cores the engines do not decode on
        cpus = environ[LEARNER_CPUS].split(",")
        out.update(OMP_NUM_THREADS="1", GOMP_CPU_AFFINITY=" ".join(cpus))
    return {**out, **(env or {})}


class LearnerGroup:
    """`worker_cls`: the class each rank's actor runs, a LearnerWorker. A run's policy uses
    resync.learner_actor.RayLearnerWorker (adds the sync methods; actors.start_learner passes it),
    so this module needs nothing from resync."""

    def __init__(self, settings: LearnerConfig, seed: int, role: str = "policy",
                 num_cpus_per_rank: float = 0.01, num_gpus_per_rank: float = 0.0, env: dict | None = None,
                 worker_cls: type[LearnerWorker] = LearnerWorker, scheduling: list | None = None):
        """`scheduling`: one Ray scheduling strategy per rank (actors.build_actors' placement group
        bundles); the rendezvous is then on rank 0's node, which need not be the driver's."""
        world = settings.tp * settings.pp * settings.dp
        env = rank_env(num_gpus_per_rank, env)
        remote_cls = ray.remote(worker_cls)
        opts = dict(num_cpus=num_cpus_per_rank, num_gpus=num_gpus_per_rank, runtime_env={"env_vars": env})
        where = [{"scheduling_strategy": s} for s in scheduling] if scheduling else [{}] * world
        if scheduling:
            addr, port = ray.get(_rendezvous.options(num_cpus=0, **where[0]).remote())
        else:
            addr, port = ray.util.get_node_ip_address(), free_port()
        self.actors = [remote_cls.options(**opts, **where[rank]).remote(rank, world, addr, port, settings,
                                                                         seed=seed, role=role)
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

    def shutdown(self) -> None:
        for a in self.actors:
            try:
                ray.get(a.shutdown.remote(), timeout=30)
            except Exception:
                pass
            ray.kill(a)
