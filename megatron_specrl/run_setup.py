"""Everything a run holds between steps, built once: model dir, data, Ray, learner, engines, store, logger.

Also the parts of the loop that are not the step itself: resume, checkpoint,
eval and the end-of-run export, so trainer.py stays one screen.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, TypeVar

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from megatron_specrl import checkpoint as ckpt
from megatron_specrl.algorithms.kl_reward import RewardKLController
from megatron_specrl.config import ConfigError, RunConfig, check_model_divisibility, to_yaml
from megatron_specrl.engines.protocol import (DraftsFromTrees, GenerateRequest, RolloutEngine, RoutesToEngines,
                                              SamplingSettings)
from megatron_specrl.metrics import MetricsLogger, plot_metrics
from megatron_specrl.placement import Placement, cluster_gpus, plan_placement
from megatron_specrl.resync.choose import resolve_transport
from megatron_specrl.resync.routes import Route, make_route
from megatron_specrl.models.resolve import (read_hf_config, resolve_draft_model, resolve_model, shape_of,
                                           tokenizer_fingerprint)
from megatron_specrl.rollout.draft_tree import DraftTrees
from megatron_specrl.rollout.dump import set_aside_later_dumps
from megatron_specrl.rollout.speculative import SpeculativeRollout, stable_seed
from megatron_specrl.rollout.store import TrajectoryStore

if TYPE_CHECKING:   # types only: these pull in Ray, transformers and the dataset readers
    from transformers import PreTrainedTokenizerBase

    from megatron_specrl.data.datasets import PromptLoader, PromptRecord
    from megatron_specrl.learner.group import LearnerGroup
    from megatron_specrl.rewards import RewardFn

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class Run:
    cfg: RunConfig
    out: Path
    model_dir: Path
    tokenizer: PreTrainedTokenizerBase
    pad_id: int
    tokenizer_id: str
    loader: PromptLoader
    train_records: dict[str, PromptRecord]
    eval_records: list[PromptRecord]
    train_prompt_ids: dict[str, list[int]]    # every prompt rendered once at start-up (data.max_prompt_len checked)
    eval_prompt_ids: dict[str, list[int]]
    reward_fn: RewardFn
    learner: LearnerGroup
    engine: RolloutEngine             # one engine, or an EngineRouter over several
    store: TrajectoryStore
    rollout: SpeculativeRollout
    logger: MetricsLogger
    placement: Placement
    resync_route: Route               # the route of trainer.resync_transport (broadcast keeps its group)
    critic: LearnerGroup | None = None        # PPO's value model
    ref: LearnerGroup | None = None           # frozen KL reference (RunConfig.needs_reference)
    reward_kl: RewardKLController | None = None   # beta of the KL in the reward (algorithm.use_kl_in_reward)
    step: int = 0
    version: int = 0
    progress: Progress = field(default_factory=lambda: Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=False))

    def next_prompts(self) -> list[tuple[str, list[int]]]:
        """The loader's next batch (a rollout round: trainer.gen_prompts_per_step) as (prompt id, token ids)."""
        return [(r.id, self.train_prompt_ids[r.id]) for r in self.loader.next_batch()]

    def upcoming_prompts(self) -> list[tuple[str, list[int]]]:
        """The batch next_prompts() returns next, without taking it (run-ahead drafting)."""
        return [(r.id, self.train_prompt_ids[r.id]) for r in self.loader.peek_batch()]

    def probe_prompts(self, n: int = 8) -> list[list[int]]:
        """A few held-out prompts (training ones when there is no eval set) for the resync check."""
        if self.eval_records:
            return [self.eval_prompt_ids[r.id] for r in self.eval_records[:n]]
        return [self.train_prompt_ids[r.id] for r in list(self.train_records.values())[:n]]

    def resync(self, wake_engines: bool = False) -> dict[str, float]:
        """Push the learner's current weights to every engine as weight version `self.version`."""
        from megatron_specrl.resync.lifecycle import sync_weights
        return sync_weights(self.learner, self.engine, self.version, self.cfg.trainer.resync_bucket_mb << 20,
                            wake_engines=wake_engines, route=self.resync_route,
                            dtype=self.cfg.rollout.engine_dtype)

    def record_data_order(self, step: int, samples) -> None:
        """Which prompts each step trained on: makes data order after a resume checkable."""
        import json
        ids = list(dict.fromkeys(s.prompt_id for s in samples))
        with open(self.out / "data_order.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "prompt_ids": ids}) + "\n")

    def finish(self) -> None:
        """End of run: final checkpoint, HF export, plots."""
        if self.cfg.trainer.checkpoint_every and not (self.out / "checkpoints" / ckpt.step_dir_name(self.step)).exists():
            save_run_checkpoint(self)
        if self.cfg.trainer.export_hf:
            self.learner.export_hf(str(self.out / "hf_final"))
        if self.cfg.logging.plots:
            plot_metrics(self.out / "metrics.jsonl", self.out / "plots")

    def shutdown(self) -> None:
        for closer in (self.logger.close, self.engine.shutdown, self.learner.shutdown,
                       *(x.shutdown for x in (self.critic, self.ref) if x is not None)):
            try:
                closer()
            except Exception as e:  # keep shutting the rest down
                log.warning("shutdown: %s", e)


def build_run(cfg: RunConfig) -> Run:
    from megatron_specrl.actors import build_actors, init_ray
    from megatron_specrl.data.datasets import DatasetError, PromptLoader, load_records, render_all
    from megatron_specrl.rewards import default_reward_for, get_reward

    out = Path(cfg.output_dir)
    check_engine_installed(cfg.rollout.engine)
    resume_from = find_resume(cfg, out)     # before anything is written into an earlier run's directory
    model_dir = resolve_model(cfg.model, seed=0, task_terms=tuple(cfg.data.synthetic_terms))
    hf_config = read_hf_config(model_dir)
    check_model_divisibility(cfg, *shape_of(hf_config), intermediate_size=hf_config.get("intermediate_size"),
                             max_positions=hf_config.get("max_position_embeddings"))
    rollout_cfg = cfg.rollout
    if cfg.rollout.draft == "model":   # checked before Ray and the engines start; engines get its directory
        draft_dir = resolve_draft_model(cfg.model, cfg.rollout.draft_model, model_dir, tuple(cfg.data.synthetic_terms))
        rollout_cfg = cfg.rollout.model_copy(update={"draft_model": str(draft_dir)})
    tokenizer = load_tokenizer(cfg.model.path, model_dir, hf_config)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    d = cfg.data
    train_all = load_records(d, split="train", seed=cfg.trainer.seed)
    train_records, train_ids = render_all(train_all, tokenizer, d.apply_chat_template, d.max_prompt_len,
                                          d.filter_overlong_prompts, "train")
    if len(train_records) < cfg.trainer.gen_prompts_per_step:
        raise DatasetError(f"data.source={d.source!r}: {len(train_records)} train prompts"
                           + (f" (data.filter_overlong_prompts left them of {len(train_all)})"
                              if len(train_records) < len(train_all) else "")
                           + f", fewer than {cfg.trainer.round_prompts_key()}")
    eval_records, eval_ids = render_all(load_records(d, split="eval", seed=cfg.trainer.seed) if d.num_eval else [],
                                        tokenizer, d.apply_chat_template, d.max_prompt_len,
                                        d.filter_overlong_prompts, "eval")
    loader = PromptLoader(train_records, batch_size=cfg.trainer.gen_prompts_per_step, seed=cfg.trainer.seed,
                          shuffle=cfg.data.shuffle)

    state = ckpt.load_state(resume_from) if resume_from else None
    aside = None   # where the abandoned run's later checkpoints went, if anywhere
    tokenizer_id = tokenizer_fingerprint(model_dir)
    if state is not None:   # a checkpoint that is not this run's: one line, before Ray and the actors start
        ckpt.check_tokenizer(state, resume_from, tokenizer_id, model_dir)
        ckpt.check_model(resume_from, model_dir)
        ckpt.check_optimizer(resume_from, cfg.learner.distributed_optimizer)
        if cfg.algorithm.name == "ppo" and not (resume_from / "critic").is_dir():
            raise ConfigError(f"trainer.resume: checkpoint {resume_from} has no critic (it was not a PPO run); "
                              f"algorithm.name=ppo needs one")
        try:
            loader.load_state_dict(state["loader"])
        except ValueError as e:   # other data, seed or shuffling: the data order cannot continue
            raise ConfigError(f"trainer.resume: checkpoint {resume_from}: {e}") from None
        # resumed from an older checkpoint: the abandoned run's later ones go aside (kept, with its
        # logs), or resume=auto and engine restarts would continue that run
        aside = ckpt.set_aside_newer(out / "checkpoints", state["step"],
                                     logs=(out / "metrics.jsonl", out / "data_order.jsonl"))
    if cfg.trainer.rollout_data_dir:   # and the rollout dumps of steps past this start (see its docstring)
        set_aside_later_dumps(cfg.trainer.rollout_data_dir, state["step"] if state else 0,
                              name=aside.name if aside is not None else None)

    # every check above only read: an earlier run's config.yaml is replaced once this run really starts
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(to_yaml(cfg))
    init_ray(cfg.ray)
    placement = plan_placement(cfg, cluster_gpus())
    transport = resolve_transport(cfg.trainer.resync_transport, placement, cfg.rollout.num_engines,
                                  cfg.rollout.engine)
    actors = build_actors(model_dir, cfg.learner, rollout_cfg, seed=cfg.trainer.seed, log_dir=out / "engine_logs",
                          critic_lr=cfg.algorithm.critic_lr if cfg.algorithm.name == "ppo" else None,
                          critic_lr_warmup_steps=cfg.algorithm.critic_lr_warmup_steps,
                          critic_weight_decay=cfg.algorithm.critic_weight_decay,
                          critic_grad_clip=cfg.algorithm.critic_grad_clip,
                          reference=cfg.needs_reference,
                          learner_gpus_per_rank=placement.learner_gpus_per_rank,
                          gpus_per_engine=placement.gpus_per_engine)
    learner, engine, critic, ref = actors.learner, actors.engine, actors.critic, actors.reference

    store = TrajectoryStore()
    step = version = 0
    resumed = state is not None
    if resumed:
        learner.load_checkpoint(str(resume_from / "learner"))
        if critic is not None:
            critic.load_checkpoint(str(resume_from / "critic"))
        store = TrajectoryStore.load(resume_from)
        step, version = state["step"], state["weight_version"]

    reward_kl = None
    if cfg.algorithm.use_kl_in_reward:
        k = cfg.algorithm.kl_ctrl
        reward_kl = RewardKLController(k.type, k.kl_coef, k.target_kl, k.horizon)
        if resumed and "reward_kl" in state:
            reward_kl.load_state_dict(state["reward_kl"])

    sampling = SamplingSettings(cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.top_k)
    rollout = SpeculativeRollout(engine, store, mode=cfg.rollout.spec_mode, lenience=cfg.rollout.lenience,
                                 sampling=sampling, max_new_tokens=cfg.rollout.max_new_tokens, seed=cfg.trainer.seed,
                                 coupled_refresh=cfg.rollout.coupled_refresh, runahead=cfg.rollout.runahead,
                                 verify=cfg.rollout.verify)
    logger = MetricsLogger(out, cfg.model_dump(mode="json"), use_wandb=cfg.logging.wandb,
                           wandb_mode=cfg.logging.wandb_mode, project=cfg.logging.project,
                           run_name=cfg.logging.run_name, resume_step=step)
    run = Run(cfg=cfg, out=out, model_dir=model_dir, tokenizer=tokenizer, pad_id=pad_id, tokenizer_id=tokenizer_id,
              loader=loader, train_records={r.id: r for r in train_records}, eval_records=eval_records,
              train_prompt_ids=train_ids, eval_prompt_ids=eval_ids,
              reward_fn=get_reward(cfg.reward.name or default_reward_for(cfg.data)), learner=learner, engine=engine, store=store,
              rollout=rollout, logger=logger, placement=placement, critic=critic, ref=ref, reward_kl=reward_kl, step=step, version=version,
              resync_route=make_route(transport, timeout_s=cfg.rollout.engine_timeout_s))
    logger.console.print(f"weight resync transport: {transport} (trainer.resync_transport="
                         f"{cfg.trainer.resync_transport})")
    if resumed:   # the engines started from the HF weights: give them the checkpoint's
        run.resync()
        if drafts_with_trees(run):   # a run resumed with rollout.draft=none leaves the saved trees alone
            restore_draft_trees(engine, resume_from / "draft_trees")
        log.warning("resumed from %s at step %d (weight version %d, %d stored trajectories)",
                    resume_from, step, version, len(store))
    return run


def load_tokenizer(model_path: str, model_dir: Path, hf_config: dict) -> PreTrainedTokenizerBase:
    """model.path's tokenizer, refused in one line where transformers cannot load one (a directory holding
    only weights and config.json) or where it has ids past the model's vocab_size (they would index past
    the embedding inside the learner and the engines)."""
    from transformers import AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:   # OSError / ValueError / TypeError, depending on what is missing
        raise ConfigError(f"model.path={model_path!r}: cannot load its tokenizer ({type(e).__name__}: "
                          f"{' '.join(str(e).split())[:300]}); the directory needs tokenizer.json or "
                          "tokenizer_config.json beside config.json") from None
    vocab = hf_config.get("vocab_size")
    if isinstance(vocab, int) and len(tokenizer) > vocab:
        raise ConfigError(f"model.path={model_path!r}: the tokenizer has {len(tokenizer)} tokens, more than the "
                          f"model's vocab_size={vocab} (config.json): a tokenizer of another model?")
    return tokenizer


def check_engine_installed(engine: str) -> None:
    """The rollout engine's package must be importable here: otherwise the run would fail only once Ray
    and the learner are up, when the engine actor's start raises (find_spec imports nothing)."""
    if engine not in sys.modules and importlib.util.find_spec(engine) is None:
        raise ConfigError(f"rollout.engine={engine!r}: the {engine} package is not installed in this environment"
                          + ("" if engine == "vllm" else " (the default engine is vllm)"))


def find_resume(cfg: RunConfig, out: Path) -> Path | None:
    resume = cfg.trainer.resume
    if resume == "never":
        # a fresh run in an earlier run's directory would trim its metrics.jsonl to nothing, and the
        # earlier run's later checkpoints (not pruned by this one's) would be what resume=auto continues
        earlier = ckpt.find_latest(out / "checkpoints")
        if earlier is not None or (out / "metrics.jsonl").is_file():
            raise ConfigError(f"trainer.resume=never: output_dir={str(out)!r} holds an earlier run ("
                              + (f"checkpoint {earlier.name}" if earlier else "metrics.jsonl") + "); use another "
                              "output_dir, remove it, or trainer.resume=auto to continue that run")
        return None
    if resume == "auto":
        return ckpt.find_latest(out / "checkpoints")
    path = Path(resume)
    problem = ckpt.verify(path) if path.is_dir() else ("not a directory" + ("" if path.exists() else " (nothing there)"))
    if problem and not (path / ckpt.MANIFEST).is_file() and path.is_dir():   # the wrong level of a checkpoint tree?
        if (path.parent / ckpt.MANIFEST).is_file():           # checkpoints/step_N/learner
            problem = f"a part of checkpoint {path.parent}; pass trainer.resume={str(path.parent)!r}"
        elif any(path.glob("step_*")) or any(path.glob("checkpoints/step_*")):   # checkpoints/, or a run's output_dir
            root = path if any(path.glob("step_*")) else path / "checkpoints"
            latest = ckpt.find_latest(root)
            problem = ("a directory of checkpoints, not one: pass one of its step_* directories"
                       + (f" (the newest complete: {latest})" if latest else " (none is complete)")
                       + ", or trainer.resume=auto with its output_dir")
        elif not (path / "trainer_state.json").is_file():
            problem = "not a checkpoint (no manifest.json: a run's checkpoints are its output_dir/checkpoints/step_N)"
    if problem:
        raise ConfigError(f"trainer.resume={resume!r}: {problem}")
    return path


def save_run_checkpoint(run: Run) -> Path:
    from megatron_specrl.learner.convert import copy_hf_metadata
    tmp = ckpt.begin(run.out / "checkpoints", run.step)
    run.learner.save_checkpoint(str(tmp / "learner"))
    # the model's config and tokenizer beside the weights: `convert mcore-to-hf --ckpt <step>/learner`
    copy_hf_metadata(Path(run.model_dir), tmp / "learner" / "hf")
    if run.critic is not None:
        run.critic.save_checkpoint(str(tmp / "critic"))
    run.store.save(tmp)
    save_draft_trees(run.engine, tmp / "draft_trees")
    state = {"step": run.step, "weight_version": run.version, "loader": run.loader.state_dict(),
             "tokenizer": run.tokenizer_id, "model_dir": str(run.model_dir)}
    if run.reward_kl is not None:
        state["reward_kl"] = run.reward_kl.state_dict()
    return ckpt.commit(tmp, state, keep=run.cfg.trainer.keep_checkpoints)


ENGINE_TREES = "engine-{}"   # one directory per engine, by its index in the router (0 without one)


def drafts_with_trees(run: Run) -> bool:
    """Whether this run's engines hold draft trees (rollout.draft=tree). A checkpoint written with
    trees can be resumed with drafting off: its engines refuse trees (load_draft_state raises)."""
    return run.cfg.rollout.draft == "tree"


def save_draft_trees(engine, directory: Path) -> None:
    """The engines' per-prompt draft trees (rollout.draft=tree), one directory per engine, so a
    resumed run drafts as well as before the crash."""
    state = engine.draft_state() if isinstance(engine, DraftsFromTrees) else None
    if state is None:
        return
    for i, s in enumerate(state["engines"] if "engines" in state else [state]):
        if s is not None:
            DraftTrees.save_state(s, directory / ENGINE_TREES.format(i))


def restore_draft_trees(engine, directory: Path) -> None:
    """Load what save_draft_trees wrote into the same engines; a checkpoint without trees (drafting
    was off, or an older checkpoint) leaves them empty."""
    if not directory.is_dir() or not isinstance(engine, DraftsFromTrees):
        return
    dirs, i = [], 0
    while (directory / ENGINE_TREES.format(i)).is_dir():
        dirs.append(directory / ENGINE_TREES.format(i))
        i += 1
    if not dirs:
        return
    states = [DraftTrees.load_state(d) for d in dirs]
    if isinstance(engine, RoutesToEngines):   # a router: one state per engine, in order
        engine.load_draft_state({"engines": states})
    else:
        engine.load_draft_state(states[0])


def with_engine_recovery(run: Run, step: int, collect: Callable[[], tuple[list, T, dict]]) -> tuple[list, T, dict]:
    """collect() -> (samples, rewards, metrics); if an engine dies, restart it, push the current
    weights and collect once more from the same prompts (the loader is rewound, so the data order
    does not change, and the trajectory store too, so the retry drafts from last epoch's samples)."""
    from megatron_specrl.engines.protocol import EngineError

    loader_state = run.loader.state_dict()
    run.store.begin_step()
    try:
        return collect()
    except EngineError as err:
        log.warning("rollout of step %d failed: %s; restarting the engines at weight version %d",
                    step, str(err).splitlines()[0], run.version)
    restart_engines(run, resync=run.version > 0)   # version 0: the model's own weights, which they load
    run.loader.load_state_dict(loader_state)
    run.store.undo_step()
    samples, rewards, metrics = collect()
    metrics["engine/restarts"] = 1.0
    return samples, rewards, metrics


def resync_with_recovery(run: Run, step: int, wake_engines: bool = False) -> dict[str, float]:
    """run.resync(); if an engine dies or the transport fails on the way (a half-loaded engine then holds
    a mix of two versions), restart every engine and push the weights once more: the learner holds them,
    so nothing is lost. A second failure ends the run (launch requeues it; resume continues from the
    newest checkpoint)."""
    from megatron_specrl.engines.protocol import EngineError
    from megatron_specrl.resync.group import ResyncTransportError   # timeouts of every route included

    try:
        return run.resync(wake_engines=wake_engines)
    except (EngineError, ResyncTransportError) as err:
        log.warning("resync of step %d failed: %s; restarting the engines at weight version %d",
                    step, str(err).splitlines()[0], run.version)
    metrics = restart_engines(run)
    metrics["engine/resync_restarts"] = 1.0
    return metrics


def restart_engines(run: Run, resync: bool = True) -> dict[str, float]:
    """Fresh engines (the model from its path), then the learner's current weights (the resync's
    metrics), drafting from the trees of the newest checkpoint."""
    from megatron_specrl.engines.protocol import EngineError
    from megatron_specrl.resync.group import ResyncTransportError, first_line
    from megatron_specrl.resync.lifecycle import engines_of

    engines = engines_of(run.engine)
    for e in engines:
        e.restart()
    try:
        metrics = run.resync() if resync else {}
    except ResyncTransportError as err:   # the second failure ends the run: the CLI's one engine-error line
        raise EngineError(f"weight resync to the restarted engines failed: {first_line(err)}",
                          ", ".join(getattr(e, "name", "?") for e in engines)) from err
    latest = ckpt.find_latest(run.out / "checkpoints") if drafts_with_trees(run) else None
    if latest is not None:
        restore_draft_trees(run.engine, latest / "draft_trees")
    return metrics


def evaluate(run: Run) -> dict[str, float]:
    """Accuracy on the held-out prompts (plain generation, no drafts): greedy, or with
    rollout.val_kwargs.do_sample n seeded samples a prompt. eval/accuracy and eval/reward_mean are
    means over every sample (verl's mean@n); with n > 1 also eval/pass@n, the share of prompts with a
    correct sample."""
    if not run.eval_records:
        return {}
    vk = run.cfg.rollout.val_kwargs
    sampling = (SamplingSettings(vk.temperature, vk.top_p, vk.top_k, need_logprobs=False) if vk.do_sample
                else SamplingSettings(temperature=0.0, need_logprobs=False))
    n = vk.n if vk.do_sample else 1
    records = [r for r in run.eval_records for _ in range(n)]
    # the first sample keeps greedy eval's seed; others are seeded by their index (the same at every eval)
    reqs = [GenerateRequest(run.eval_prompt_ids[r.id], run.cfg.rollout.max_new_tokens,
                            seed=stable_seed("eval", r.id) if k == 0 else stable_seed("eval", r.id, k))
            for r in run.eval_records for k in range(n)]
    results = run.engine.generate(reqs, sampling, run.version)
    texts = run.tokenizer.batch_decode([r.token_ids for r in results], skip_special_tokens=True)
    scores = [float(run.reward_fn(t, rec)) for t, rec in zip(texts, records)]
    metrics = {"eval/reward_mean": sum(scores) / len(scores),
               "eval/accuracy": sum(s > 0 for s in scores) / len(scores)}
    if n > 1:
        solved = [any(s > 0 for s in scores[i:i + n]) for i in range(0, len(scores), n)]
        metrics[f"eval/pass@{n}"] = sum(solved) / len(solved)
    return metrics

