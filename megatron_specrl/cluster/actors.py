"""Start Ray and the run's actors: the learner group(s) and the rollout engine(s).

The one place that wires them, used by run.build.build_run, the check-resync diagnostic and
bench-resync (benchmarks/resync.py), so all three run the same actors. It is also where the learner meets the
resync machinery: the policy's ranks run resync.learner_actor.RayLearnerWorker, a LearnerWorker
with the sync methods, injected here so that learner/ never imports resync/.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from megatron_specrl.config import LearnerConfig, RayConfig, RolloutConfig
from megatron_specrl.engines.protocol import RolloutEngine
from megatron_specrl.learner.group import LearnerGroup


def init_ray(cfg: RayConfig | None = None) -> bool:
    """ray.init once for this process (local, or joining `cfg.address`); True if this call started it."""
    import ray
    if ray.is_initialized():
        return False
    cfg = cfg or RayConfig()
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # address None means a Ray of our own: "local", because ray.init(address=None) joins any Ray
    # already running on the machine (another user's `ray start`, another run's driver).
    kwargs = dict(address=cfg.address or "local", include_dashboard=False, log_to_driver=cfg.log_to_driver)
    if cfg.address is None:
        kwargs["num_cpus"] = cfg.num_cpus or max(os.cpu_count() or 2, 2)
        # no idle workers (one a CPU) started with the driver: the learner ranks and engines all carry a
        # runtime_env, so none runs in them, and on a small machine they took cores from the actors'
        # start (~1 s of the tiny CPU run's start-up on 2 cores)
        kwargs["_system_config"] = {"prestart_worker_first_driver": False}
    else:
        _check_ray_token(cfg.address)
    ray.init(**kwargs)
    return True


def _check_ray_token(address: str) -> None:
    """A cluster with token authentication that refuses this driver's token: one line (ray_join.token_refused)
    instead of ray.init's ConnectionError after its retries. A config error, so launch does not requeue."""
    from ray._private.services import canonicalize_bootstrap_address

    from megatron_specrl.cluster.ray_join import token_refused
    from megatron_specrl.config import ConfigError
    try:
        resolved = canonicalize_bootstrap_address(address)
    except Exception:   # no cluster found for "auto": ray.init says so
        return
    refused = token_refused(resolved) if resolved and not resolved.startswith("ray://") else None
    if refused:
        raise ConfigError(f"ray.address={address}: {refused}")


def learner_bundles(learner: LearnerConfig, rollout: RolloutConfig, learner_gpus_per_rank: float,
                    timeout_s: float = 600.0, learner_roles: int = 1) -> tuple[list | None, list | None, list, float]:
    """Ray scheduling strategies for the learner ranks and (colocated) the engines, and the GPU share
    each of those actors asks for: (None, None, [], 0.0) on CPU.

    Without them Ray packs fractional GPUs: two colocated learner ranks got the same GPU (0.5 + 0.5),
    the engines GPUs of their own, and 1-GPU ranks spread over nodes at Ray's whim, splitting a TP
    group across nodes and leaving no node with engine_tp free GPUs. So: one placement group of one
    whole GPU a rank per TP group (STRICT_PACK: a TP group stays in one node), all reserved before any
    engine; colocated engine i shares rank i's GPU (bundle), as the cuda_ipc transport expects.
    `learner_roles` learner groups of the same layout (policy, PPO's critic, the KL reference) put
    rank r in the same bundle, as verl colocates actor, critic and reference: outside the bundles
    they found every GPU reserved and waited for one forever."""
    if not learner_gpus_per_rank:
        return None, None, [], 0.0
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    import ray

    world, tp = learner.tp * learner.pp * learner.dp, learner.tp
    colocate = rollout.colocate
    share = 1.0 / (learner_roles + colocate)      # of a bundle's GPU, for every actor in it
    bundle = {"GPU": 1.0, "CPU": 0.01 * learner_roles + (1.0 if colocate else 0.0)}   # + the engine's CPU
    groups = [placement_group([dict(bundle) for _ in range(tp)], strategy="STRICT_PACK") for _ in range(world // tp)]
    try:
        ray.get([g.ready() for g in groups], timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"learner placement: {world // tp} group(s) of {tp} GPU(s) on one node each "
                           f"(learner.tp={tp}) could not be reserved within {timeout_s:g} s; cluster resources: "
                           f"{ray.available_resources()}") from None
    ranks = [PlacementGroupSchedulingStrategy(groups[r // tp], placement_group_bundle_index=r % tp)
             for r in range(world)]
    return ranks, (ranks[:rollout.num_engines] if colocate else None), groups, share


@dataclass
class Actors:
    """What build_actors started; the critic and the frozen KL reference only when asked for."""
    learner: LearnerGroup
    engine: RolloutEngine
    critic: LearnerGroup | None = None
    reference: LearnerGroup | None = None
    placement_groups: list = field(default_factory=list)

    def shutdown(self) -> list[Exception]:
        """Stop everything, engines first; returns what failed instead of stopping half-way."""
        errors = []
        for x in (self.engine, self.learner, self.critic, self.reference):
            if x is None:
                continue
            try:
                x.shutdown()
            except Exception as e:  # keep shutting the rest down
                errors.append(e)
        if self.placement_groups:
            from ray.util.placement_group import remove_placement_group
            for g in self.placement_groups:
                remove_placement_group(g)
        return errors


def build_actors(model_dir: str | Path, learner: LearnerConfig, rollout: RolloutConfig, *, seed: int,
                 log_dir: str | Path, critic_lr: float | None = None, critic_lr_warmup_steps: int = 0,
                 critic_weight_decay: float = 0.01, critic_grad_clip: float = 1.0,
                 reference: bool = False,
                 learner_gpus_per_rank: float = 0.0, gpus_per_engine: float | None = None,
                 engine_seed: int = 0) -> Actors:
    """Policy learner (RayLearnerWorker ranks, so resync can drive them), rollout engine(s) as Ray
    actors, and optionally a PPO critic (`critic_lr`) and a frozen KL reference; every learner group
    starts from the HF weights in `model_dir`. The critic has the policy's layout and other learner
    settings but its own optimizer settings, as verl's critic.optim / critic.grad_clip: lr, warm-up
    (`critic_lr_warmup_steps`, not the policy's learner.lr_warmup_steps), weight decay and gradient clip
    (defaults: AlgorithmConfig's, verl's 0.01 and 1.0). Needs init_ray() first."""
    from megatron_specrl.engines.factory import engine_gpus, make_engine, wait_started
    from megatron_specrl.resync.learner_actor import RayLearnerWorker

    def group(settings: LearnerConfig, role: str, gpus_per_rank: float, worker_cls=None, scheduling=None) -> LearnerGroup:
        extra = {"worker_cls": worker_cls} if worker_cls is not None else {}
        g = LearnerGroup(settings, seed=seed, role=role, num_gpus_per_rank=gpus_per_rank,
                         scheduling=scheduling, **extra)
        g.load_hf(str(model_dir))
        return g

    roles = 1 + (critic_lr is not None) + reference
    rank_bundles, engine_bundles, groups, share = learner_bundles(learner, rollout, learner_gpus_per_rank,
                                                                  learner_roles=roles)
    engine_kw = dict(log_dir=str(log_dir), use_ray=True, seed=engine_seed,
                     gpus_per_engine=share if engine_bundles else gpus_per_engine, scheduling=engine_bundles)
    # No GPU anywhere: the engines build (vLLM's imports, 10+ s) while the learner ranks start and load,
    # instead of after them. With GPUs the order stays: ranks first, then the engines, which size
    # their KV cache from the GPU memory they find free (colocated: beside the ranks' weights).
    cpu_only = not learner_gpus_per_rank and not engine_gpus(rollout, engine_kw["gpus_per_engine"])
    engine = make_engine(rollout, str(model_dir), wait=False, **engine_kw) if cpu_only else None
    policy = group(learner, "policy", share, RayLearnerWorker, rank_bundles)
    critic_settings = learner.model_copy(update={"lr": critic_lr, "lr_warmup_steps": critic_lr_warmup_steps,
                                                 "weight_decay": critic_weight_decay,
                                                 "grad_clip": critic_grad_clip})
    critic = (group(critic_settings, "critic", share, scheduling=rank_bundles) if critic_lr is not None else None)
    ref = group(learner, "reference", share, scheduling=rank_bundles) if reference else None
    if engine is None:
        engine = make_engine(rollout, str(model_dir), **engine_kw)
    else:
        wait_started(engine)
    return Actors(policy, engine, critic, ref, groups)
