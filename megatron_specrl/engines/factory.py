"""Build the rollout engine(s) a RolloutConfig asks for.

One engine -> that engine; num_engines > 1 -> an EngineRouter over them. With
`use_ray` each engine is a Ray actor (needs `ray.init()` first), which is how
failures become restartable; without it engines live in this process.
"""

from __future__ import annotations

from pathlib import Path

from megatron_specrl.config import RolloutConfig
from megatron_specrl.engines.protocol import RolloutEngine


def engine_kwargs(cfg: RolloutConfig, model_path: str, log_dir: str | Path, index: int,
                  seed: int) -> tuple[type, dict]:
    """Engine class and constructor kwargs for engine `index`. `cfg` is resolved already and read as
    given: a run's resolved config's rollout section, or RolloutConfig.resolved() of one built directly
    (its auto keys decide engine arguments, such as which vLLM patches verification needs)."""
    import torch

    if not cfg.is_resolved:
        raise ValueError("the engines take a resolved RolloutConfig: the rollout section of the run's resolved "
                         "config (megatron_specrl.config.resolve.resolve), or RolloutConfig.resolved() of one "
                         "built directly")
    common = dict(model_path=str(model_path), name=f"{cfg.engine}-{index}", seed=seed + index,
                  max_model_len=cfg.max_model_len, tensor_parallel_size=cfg.engine_tp, dtype=cfg.engine_dtype,
                  gpu_memory_utilization=cfg.gpu_memory_utilization, log_dir=str(log_dir),
                  enforce_eager=cfg.enforce_eager, cudagraph_capture_sizes=cfg.cudagraph_capture_sizes,
                  max_num_seqs=cfg.max_num_seqs, engine_args=dict(getattr(cfg.engine_kwargs, cfg.engine)))
    draft = dict(draft=cfg.draft, drafter=cfg.drafter)   # rollout.drafter whole, down to the proposer
    if cfg.engine == "vllm":
        from megatron_specrl.engines.vllm import VLLMEngine
        # Generated tokens report processed log-probs (after temperature, top-k and top-p), the
        # convention of score()'s acceptance log-probs and of the trajectory store.
        mode = "processed_logprobs"
        # Sleep mode lets colocated engines hand their GPU memory to the learner during training.
        sleep = {"enable_sleep_mode": True} if cfg.colocate and torch.cuda.is_available() else {}
        # the features the rollout will use, whose vLLM patches the engine checks before vLLM is built
        uses = dict(verification=cfg.spec_mode != "off" and cfg.verify == "prefill",
                    coupled_sampling=cfg.spec_mode == "coupled")
        return VLLMEngine, dict(common, kv_cache_gb=cfg.kv_cache_gb, logprobs_mode=mode,
                                max_num_batched_tokens=cfg.max_num_batched_tokens,
                                seed_requests=cfg.seed_requests, draft_model=cfg.draft_model, **uses, **sleep, **draft)
    from megatron_specrl.engines.sglang import SGLangEngine
    # SGLang's counterpart of sleep mode: without it release_memory_occupation frees nothing
    # (it also needs the torch_memory_saver package on the GPU nodes)
    saver = {"enable_memory_saver": True} if cfg.colocate and torch.cuda.is_available() else {}
    return SGLangEngine, dict(common, **saver, **draft)


def engine_gpus(rollout_cfg: RolloutConfig, gpus_per_engine: float | None) -> float:
    """The GPUs each engine's actor asks for: `gpus_per_engine`, by default engine_tp where there is CUDA."""
    import torch

    if gpus_per_engine is None:
        return rollout_cfg.engine_tp if torch.cuda.is_available() else 0
    return gpus_per_engine


def make_engine(rollout_cfg: RolloutConfig, model_path: str, log_dir: str | Path, use_ray: bool,
                seed: int = 0, num_cpus_per_engine: float = 1,
                gpus_per_engine: float | None = None, scheduling: list | None = None,
                wait: bool = True) -> RolloutEngine:
    """`scheduling`: one Ray scheduling strategy per engine (actors.build_actors' placement groups).

    Ray engines on CPU (no GPU each) start together, not one after the other; on GPUs each engine
    still starts once the previous one has built (vLLM sizes its KV cache from the memory it finds
    free). `wait=False` (Ray engines on CPU): return while they build; wait_started() waits for them."""
    gpus_per_engine = engine_gpus(rollout_cfg, gpus_per_engine)
    together = use_ray and not gpus_per_engine
    engines = []
    for i in range(rollout_cfg.num_engines):
        cls, kwargs = engine_kwargs(rollout_cfg, model_path, log_dir, i, seed)
        if use_ray:
            from megatron_specrl.engines.ray_engine import RayEngine
            name = kwargs.pop("name")
            kwargs.pop("log_dir")
            engines.append(RayEngine(cls, kwargs, name=name, log_dir=log_dir, num_cpus=num_cpus_per_engine,
                                     num_gpus=gpus_per_engine, timeout_s=rollout_cfg.engine_timeout_s,
                                     start_timeout_s=max(600.0, rollout_cfg.engine_timeout_s),
                                     scheduling_strategy=scheduling[i] if scheduling else None,
                                     wait=not together))
        else:
            engines.append(cls(**kwargs))
    if together and wait:
        for e in engines:
            wait_started(e)
    if len(engines) == 1:
        return engines[0]
    from megatron_specrl.engines.router import EngineRouter
    return EngineRouter(engines)


def wait_started(engine: RolloutEngine) -> None:
    """Wait for the engine(s) of make_engine(wait=False) to finish starting; a failed start raises
    EngineError, as inside make_engine. Engines that started already return at once."""
    from megatron_specrl.engines.protocol import InActor
    from megatron_specrl.engines.router import EngineRouter

    for e in engine.engines if isinstance(engine, EngineRouter) else [engine]:
        if isinstance(e, InActor):   # a RayEngine; an in-process engine has started already
            e.wait_started()
