"""Start Ray and the run's actors: the learner group(s) and the rollout engine(s).

The one place that wires them, used by run_setup.build_run, the check-resync diagnostic and
tools/bench_resync.py, so all three run the same actors. It is also where the learner meets the
resync machinery: the policy's ranks run resync.learner_actor.RayLearnerWorker, a LearnerWorker
with the sync methods, injected here so that learner/ never imports resync/.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
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
    ray.init(**kwargs)
    return True


@dataclass
class Actors:
    """What build_actors started; the critic and the frozen KL reference only when asked for."""
    learner: LearnerGroup
    engine: RolloutEngine
    critic: LearnerGroup | None = None
    reference: LearnerGroup | None = None

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
        return errors


def build_actors(model_dir: str | Path, learner: LearnerConfig, rollout: RolloutConfig, *, seed: int,
                 log_dir: str | Path, critic_lr: float | None = None, reference: bool = False,
                 learner_gpus_per_rank: float = 0.0, gpus_per_engine: float | None = None,
                 engine_seed: int = 0) -> Actors:
    """Policy learner (RayLearnerWorker ranks, so resync can drive them), rollout engine(s) as Ray
    actors, and optionally a PPO critic (`critic_lr`) and a frozen KL reference; every learner group
    starts from the HF weights in `model_dir`. Needs init_ray() first."""
    from megatron_specrl.engines.factory import make_engine
    from megatron_specrl.resync.learner_actor import RayLearnerWorker

    def group(settings: LearnerConfig, role: str, worker_cls=None) -> LearnerGroup:
        extra = {"worker_cls": worker_cls} if worker_cls is not None else {}
        g = LearnerGroup(settings, seed=seed, role=role, num_gpus_per_rank=learner_gpus_per_rank, **extra)
        g.load_hf(str(model_dir))
        return g

    policy = group(learner, "policy", RayLearnerWorker)
    critic = group(learner.model_copy(update={"lr": critic_lr}), "critic") if critic_lr is not None else None
    ref = group(learner, "reference") if reference else None
    engine = make_engine(rollout, str(model_dir), log_dir=str(log_dir), use_ray=True, seed=engine_seed,
                         gpus_per_engine=gpus_per_engine)
    return Actors(policy, engine, critic, ref)
