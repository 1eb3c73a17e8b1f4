"""Colocated vs disaggregated placement: GPU shares per actor, and impossible layouts named.
"""

import pytest
from megatron_specrl.config import ConfigError, load_config
from megatron_specrl.config.placement import plan_placement

def _cfg(*over):
    return load_config(None, list(over))


def test_cpu_asks_for_no_gpus_in_either_mode():
    for colocate in ("true", "false"):
        p = plan_placement(_cfg(f"rollout.colocate={colocate}"), gpus_available=0)
        assert p.learner_gpus_per_rank == 0 and p.gpus_per_engine == 0 and not p.engines_sleep_during_training


def test_colocated_shares_each_gpu_and_sleeps_engines():
    p = plan_placement(_cfg("learner.tp=2", "learner.pp=2", "rollout.num_engines=4"), gpus_available=8)
    assert (p.learner_gpus_per_rank, p.gpus_per_engine) == (0.5, 0.5) and p.engines_sleep_during_training


def test_disaggregated_uses_separate_pools():
    p = plan_placement(_cfg("rollout.colocate=false", "learner.tp=2", "rollout.num_engines=2",
                            "rollout.engine_tp=2"), gpus_available=8)
    assert (p.learner_gpus_per_rank, p.gpus_per_engine) == (1.0, 2.0) and not p.engines_sleep_during_training


@pytest.mark.parametrize("over, gpus, needle", [
    (["rollout.colocate=false", "learner.tp=4", "rollout.num_engines=2", "rollout.engine_tp=4"], 8,
     "= 12 GPUs, the cluster has 8"),
    (["rollout.num_engines=4"], 8, "num_engines (4) <= learner world size (1)"),
    (["rollout.engine_tp=2", "learner.tp=2"], 8, "rollout.engine_tp=2"),
])
def test_impossible_layouts_are_named(over, gpus, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        plan_placement(_cfg(*over), gpus_available=gpus)


@pytest.mark.parametrize("colocate, gpus, engines, want", [
    (True, 0, 1, "ray"), (False, 0, 2, "ray"),              # CPU: the object store
    (True, 8, 1, "cuda_ipc"),                              # one engine on learner rank 0's GPU
    (True, 8, 2, "ray"),                                   # IPC cannot reach the second engine's GPU
    (False, 8, 2, "broadcast"),                            # disaggregated: NCCL
])
def test_auto_transport_follows_the_placement(colocate, gpus, engines, want):
    from megatron_specrl.resync.choose import resolve_transport
    cfg = _cfg(f"rollout.colocate={str(colocate).lower()}", f"rollout.num_engines={engines}", "learner.dp=2")
    assert resolve_transport("auto", plan_placement(cfg, gpus), engines) == want
    assert resolve_transport("ray", plan_placement(cfg, gpus), engines) == "ray"


@pytest.mark.parametrize("requested, colocate, gpus, engines, ok, needle", [
    ("broadcast", True, 0, 1, True, ""),                   # gloo on CPU
    ("broadcast", False, 8, 1, True, ""),
    ("broadcast", True, 8, 1, False, "NCCL cannot put learner rank 0 and an engine on the same GPU"),
    ("cuda_ipc", True, 8, 1, True, ""),
    ("cuda_ipc", True, 0, 1, False, "needs engines colocated on the learner's GPUs"),
    ("cuda_ipc", False, 8, 1, False, "needs engines colocated on the learner's GPUs"),
    ("cuda_ipc", True, 8, 2, False, "rollout.num_engines=2"),
    ("nccl", False, 8, 1, False, "expected auto, ray, broadcast, cuda_ipc"),
])
def test_explicit_transport_is_checked(requested, colocate, gpus, engines, ok, needle):
    from megatron_specrl.resync.choose import resolve_transport
    placement = plan_placement(_cfg(f"rollout.colocate={str(colocate).lower()}", f"rollout.num_engines={engines}",
                                    "learner.dp=2"), gpus)
    if ok:
        assert resolve_transport(requested, placement, engines) == requested
    else:
        with pytest.raises(ConfigError, match=needle):
            resolve_transport(requested, placement, engines)


def test_sglang_engines_are_never_given_cuda_ipc():
    """IPC buckets load inside vLLM's workers; a colocated SGLang engine got auto -> cuda_ipc and failed
    at the first sync (no update_weights_in_workers)."""
    from megatron_specrl.resync.choose import resolve_transport
    placement = plan_placement(_cfg("rollout.colocate=true", "rollout.num_engines=1", "learner.dp=2"), 8)
    assert resolve_transport("auto", placement, 1, "vllm") == "cuda_ipc"
    assert resolve_transport("auto", placement, 1, "sglang") == "ray"
    with pytest.raises(ConfigError, match="cuda_ipc with rollout.engine=sglang"):
        resolve_transport("cuda_ipc", placement, 1, "sglang")


def test_transport_key_rejects_unknown_values():
    with pytest.raises(ConfigError, match="'trainer.resync_transport': 'nccl'"):
        _cfg("trainer.resync_transport=nccl")
    assert _cfg().trainer.resync_transport == "auto"


@pytest.fixture(scope="module")
def fake_gpu_ray():
    """One local Ray with 16 CPUs and 8 fake GPUs for this file's placement tests (each start of Ray costs
    ~10 s of the 2 cores); every test removes its actors and placement groups, so the next finds all 8 free."""
    import ray
    ray.init(address="local", num_cpus=16, num_gpus=8, include_dashboard=False, logging_level="ERROR")
    yield ray
    ray.shutdown()


def _all_gpus_free(ray, timeout_s: float = 30.0) -> bool:
    """All 8 fake GPUs free again (Ray returns a killed actor's and a removed group's resources shortly after)."""
    import time
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("GPU", 0) != 8:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


@pytest.mark.parametrize("colocate", [True, False])
def test_ranks_get_a_gpu_each_tp_groups_stay_together_and_colocated_engines_share_their_gpu(tmp_path, colocate,
                                                                                             fake_gpu_ray):
    """Ray with 8 fake GPUs: without placement groups Ray packed two 0.5-GPU learner ranks onto one GPU
    (NCCL refuses duplicate GPUs) and gave the "colocated" engines other GPUs."""
    import ray
    from megatron_specrl.cluster.actors import learner_bundles
    from megatron_specrl.config import LearnerConfig, RolloutConfig
    from megatron_specrl.engines.ray_engine import RayEngine
    from megatron_specrl.learner.group import LearnerGroup

    class _Rank:                       # local classes: Ray ships them by value to its workers
        def __init__(self, rank, world, addr, port, settings, seed=0, role="policy"):
            self.rendezvous = (addr, port)

        def where(self):
            return ray.get_gpu_ids(), self.rendezvous

    class _Engine:
        def __init__(self, **kwargs):
            pass

    from ray.util.placement_group import remove_placement_group
    assert _all_gpus_free(ray)
    groups = []
    try:
        # colocated: 2 TP groups of 2 ranks (half a GPU each) and 4 engines, 8 Ray workers on a 2-core machine
        learner = LearnerConfig(tp=2 if colocate else 4, dp=2 if colocate else 1)
        rollout = RolloutConfig(num_engines=4 if colocate else 1, engine_tp=1 if colocate else 4, colocate=colocate)
        per_rank, per_engine = (0.5, 0.5) if colocate else (1.0, 4.0)
        ranks, engine_bundles, groups, share = learner_bundles(learner, rollout, per_rank, timeout_s=60)
        assert share == per_rank
        g = LearnerGroup(learner, seed=0, num_gpus_per_rank=share, worker_cls=_Rank, scheduling=ranks)
        where = ray.get([a.where.remote() for a in g.actors])
        gpus = [ids for ids, _ in where]
        assert all(len(ids) == 1 for ids in gpus) and len({ids[0] for ids in gpus}) == len(gpus)   # one GPU each
        assert {r for _, r in where} == {where[0][1]}
        engines = [RayEngine(_Engine, {}, name=f"e{i}", log_dir=tmp_path, num_gpus=share if colocate else per_engine,
                             scheduling_strategy=engine_bundles[i] if engine_bundles else None)
                   for i in range(rollout.num_engines)]
        engine_gpus = [ray.get(e.actor.__ray_call__.remote(lambda self: ray.get_gpu_ids())) for e in engines]
        if colocate:
            assert engine_gpus == gpus                       # engine i on learner rank i's GPU
        else:
            assert len(engine_gpus[0]) == 4 and not set(engine_gpus[0]) & {ids[0] for ids in gpus}
        for e in engines:
            e.kill()
        for a in g.actors:
            ray.kill(a)
        assert len(groups) == learner.dp * learner.pp
    finally:
        for pg in groups:
            remove_placement_group(pg)


@pytest.mark.parametrize("colocate", [True, False])
def test_critic_and_reference_ranks_share_the_policy_ranks_gpus(tmp_path, colocate, fake_gpu_ray):
    """PPO's critic and the KL reference, outside the policy's placement groups, found every GPU reserved
    and waited forever. They share policy rank r's GPU (bundle), as verl colocates actor, critic and
    reference; build_actors starts all three groups and the engines on 8 fake GPUs."""
    import ray
    from megatron_specrl.cluster import actors
    from megatron_specrl.config import LearnerConfig, RolloutConfig

    class _Rank:
        def __init__(self, rank, world, addr, port, settings, seed=0, role="policy"):
            self.role = role

        def load_hf(self, hf_dir):
            pass

        def where(self):
            return self.role, ray.get_gpu_ids()

        def shutdown(self):
            pass

    class _Engine:
        def __init__(self, **kwargs):
            pass

    assert _all_gpus_free(ray)
    learner = LearnerConfig(tp=2, dp=2 if colocate else 1)
    rollout = RolloutConfig(num_engines=4 if colocate else 1, engine_tp=1 if colocate else 2, colocate=colocate,
                            engine_timeout_s=60)
    built, engine_share = _build_with_fakes(actors, learner, rollout, _Rank, _Engine, 0.5 if colocate else 1.0,
                                            None if colocate else 2.0, tmp_path)
    assert engine_share == (0.25 if colocate else 2.0)     # policy, critic, reference (and engine) a GPU
    try:
        where = {g: ray.get([a.where.remote() for a in getattr(built, g).actors], timeout=60)
                 for g in ("learner", "critic", "reference")}
        policy_gpus = [ids for _, ids in where["learner"]]
        assert all(len(ids) == 1 for ids in policy_gpus) and len({i[0] for i in policy_gpus}) == len(policy_gpus)
        assert [ids for _, ids in where["critic"]] == policy_gpus == [ids for _, ids in where["reference"]]
        assert [r for r, _ in where["critic"]] == ["critic"] * len(policy_gpus)
    finally:
        built.shutdown()


def _build_with_fakes(actors, learner, rollout, rank_cls, engine_cls, per_rank, per_engine, tmp_path):
    """actors.build_actors with a fake learner rank class for every role and a fake engine class."""
    from unittest import mock

    from megatron_specrl.engines import factory
    from megatron_specrl.engines.ray_engine import RayEngine
    from megatron_specrl.learner import group as group_mod

    real_group, seen = group_mod.LearnerGroup, {}

    def fake_group(settings, seed, role="policy", worker_cls=None, **kw):
        return real_group(settings, seed, role=role, worker_cls=rank_cls, **kw)

    def fake_engine(rollout_cfg, model_dir, log_dir, use_ray, seed, gpus_per_engine, scheduling):
        seen["gpus_per_engine"] = gpus_per_engine
        return RayEngine(engine_cls, {}, name="e0", log_dir=log_dir, num_gpus=gpus_per_engine,
                         scheduling_strategy=scheduling[0] if scheduling else None)

    with mock.patch.object(actors, "LearnerGroup", fake_group), mock.patch.object(factory, "make_engine", fake_engine):
        built = actors.build_actors(tmp_path, learner, rollout, seed=0, log_dir=tmp_path, critic_lr=1e-5,
                                    reference=True, learner_gpus_per_rank=per_rank, gpus_per_engine=per_engine)
    return built, seen["gpus_per_engine"]
