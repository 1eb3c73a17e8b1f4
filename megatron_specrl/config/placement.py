"""Where learner ranks and engines run: colocated (sharing GPUs) or disaggregated (separate pools).

Colocated: each learner rank and an engine share a GPU (Ray fractional GPUs; PPO's critic and the KL
reference ranks share it too, actors.learner_bundles); the engines
release their memory (vLLM sleep mode) while the learner trains and take it back for the resync.
Disaggregated: the learner gets `world_size` GPUs and the engines `num_engines * engine_tp` others,
and rollouts never wait for memory. On a CPU machine nothing asks for GPUs and both modes run the
same code path.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_specrl.config import ConfigError, RunConfig


@dataclass(frozen=True)
class Placement:
    colocate: bool
    learner_gpus_per_rank: float
    gpus_per_engine: float

    @property
    def engines_sleep_during_training(self) -> bool:
        return self.colocate and self.gpus_per_engine > 0


def plan_placement(cfg: RunConfig, gpus_available: int) -> Placement:
    r = cfg.rollout
    world, engine_gpus = cfg.world_size, r.num_engines * r.engine_tp
    if gpus_available == 0:
        return Placement(r.colocate, 0.0, 0.0)
    if r.colocate:
        if r.engine_tp != 1:
            raise ConfigError(f"rollout.colocate=true with rollout.engine_tp={r.engine_tp}: colocated engines "
                              "share one GPU with one learner rank each; use engine_tp=1 or colocate=false")
        if engine_gpus > world or world > gpus_available:
            raise ConfigError(f"rollout.colocate=true needs rollout.num_engines ({r.num_engines}) <= learner "
                              f"world size ({world}) <= GPUs ({gpus_available})")
        return Placement(True, 0.5, 0.5)
    if world + engine_gpus > gpus_available:
        raise ConfigError(f"rollout.colocate=false needs learner world size {world} + engines "
                          f"{r.num_engines} x engine_tp {r.engine_tp} = {world + engine_gpus} GPUs, "
                          f"the cluster has {gpus_available}")
    return Placement(False, 1.0, float(r.engine_tp))


def cluster_gpus() -> int:
    import ray
    return int(ray.cluster_resources().get("GPU", 0))
