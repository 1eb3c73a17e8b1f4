"""build_run: a run from its config, in the order that fails cheapest first: every check that only
reads (engine installed, checkpoint to resume, model, tokenizer, data, the checkpoint being this
run's) before the run writes into its output_dir and starts Ray, the learner and the engines."""

from __future__ import annotations

import importlib.util
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_specrl.algorithms.kl_reward import RewardKLController
from megatron_specrl.config import ConfigError, RunConfig, to_yaml
from megatron_specrl.config.placement import cluster_gpus, plan_placement
from megatron_specrl.metrics.sinks import MetricsLogger
from megatron_specrl.models.resolve import read_hf_config, resolve_draft_model, resolve_model, tokenizer_fingerprint
from megatron_specrl.plan import check_model_fits
from megatron_specrl.resync.choose import resolve_transport
from megatron_specrl.resync.routes import make_route
from megatron_specrl.rollout.speculative import SpeculativeRollout
from megatron_specrl.rollout.store import TrajectoryStore
from megatron_specrl.run.checkpointing import check_resume, find_resume, load_learners, resume_engines
from megatron_specrl.run.state import Run

if TYPE_CHECKING:   # types only: these pull in Ray, transformers and the dataset readers
    from transformers import PreTrainedTokenizerBase

    from megatron_specrl.data.datasets import PromptLoader, PromptRecord

log = logging.getLogger(__name__)


@dataclass
class _Model:
    """The policy's directory, config and tokenizer."""
    model_dir: Path
    hf_config: dict
    tokenizer: PreTrainedTokenizerBase
    pad_id: int


@dataclass
class _Data:
    train_records: list[PromptRecord]
    train_ids: dict[str, list[int]]
    eval_records: list[PromptRecord]
    eval_ids: dict[str, list[int]]
    loader: PromptLoader


def build_run(cfg: RunConfig) -> Run:
    """`cfg`: the resolved config (config.resolve.resolve; train() hands it on), read as given. The Run
    holds it with rollout.draft_model located (prepare_model): the one config of the run."""
    from megatron_specrl.rewards import default_reward_for, get_reward

    if not cfg.is_resolved:
        raise ValueError("build_run takes the resolved config: megatron_specrl.config.resolve.resolve(cfg) "
                         "(train() resolves a loaded config itself)")
    out = Path(cfg.output_dir)
    check_engine_installed(cfg.rollout.engine)
    resume_from = find_resume(cfg, out)     # before anything is written into an earlier run's directory
    cfg, model = prepare_model(cfg)
    data = load_data(cfg, model.tokenizer)
    tokenizer_id = tokenizer_fingerprint(model.model_dir)
    # a checkpoint that is not this run's: one line, before Ray and the actors start
    state = check_resume(cfg, out, resume_from, model.model_dir, tokenizer_id, data.loader)

    # every check above only read: an earlier run's config.yaml is replaced once this run really starts
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(to_yaml(cfg))
    actors, placement, transport = start_actors(cfg, model, out)
    learner, engine, critic = actors.learner, actors.engine, actors.critic

    store, step, version = (load_learners(resume_from, state, learner, critic) if state is not None
                            else (TrajectoryStore(), 0, 0))
    reward_kl = reward_controller(cfg, state)
    rollout = SpeculativeRollout.from_config(engine, store, cfg.rollout, seed=cfg.trainer.seed)
    logger = MetricsLogger(out, cfg.model_dump(mode="json"), use_wandb=cfg.logging.wandb,
                           wandb_mode=cfg.logging.wandb_mode, project=cfg.logging.project,
                           run_name=cfg.logging.run_name, resume_step=step)
    run = Run(cfg=cfg, out=out, model_dir=model.model_dir, tokenizer=model.tokenizer, pad_id=model.pad_id,
              tokenizer_id=tokenizer_id, loader=data.loader, train_records={r.id: r for r in data.train_records},
              eval_records=data.eval_records, train_prompt_ids=data.train_ids, eval_prompt_ids=data.eval_ids,
              reward_fn=get_reward(cfg.reward.name or default_reward_for(cfg.data)), learner=learner,
              engine=engine, store=store, rollout=rollout, logger=logger, placement=placement, critic=critic,
              ref=actors.reference, reward_kl=reward_kl, step=step, version=version,
              resync_route=make_route(transport, timeout_s=cfg.rollout.engine_timeout_s))
    logger.console.print(f"weight resync transport: {transport} (trainer.resync_transport="
                         f"{cfg.trainer.resync_transport})")
    if state is not None:
        resume_engines(run, resume_from)
    return run


def prepare_model(cfg: RunConfig) -> tuple[RunConfig, _Model]:
    """The model directory (built or fetched), checked against the parallel layout, the draft model's
    directory (rollout.draft=model: checked before Ray and the engines start) and the tokenizer; with
    `cfg` as the run holds it from here on: rollout.draft_model set to that directory. The one place a
    config key is resolved by building something (a tiny draft model's name builds and warms it up),
    which is why the pure resolve step (config.resolve) leaves it here."""
    model_dir = resolve_model(cfg.model, seed=0, task_terms=tuple(cfg.data.synthetic_terms))
    check_model_fits(cfg, model_dir)   # the plan's layout and context lines, for a run started without the CLI
    hf_config = read_hf_config(model_dir)
    if cfg.rollout.draft == "model":   # the engines, and every later reader of cfg, get its directory
        draft_dir = resolve_draft_model(cfg.model, cfg.rollout.draft_model, model_dir, tuple(cfg.data.synthetic_terms))
        # model_copy keeps the copies frozen as the resolved config is (pydantic copies the private flag)
        cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"draft_model": str(draft_dir)})})
    tokenizer = load_tokenizer(cfg.model.path, model_dir, hf_config)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return cfg, _Model(model_dir, hf_config, tokenizer, pad_id)


def load_data(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase) -> _Data:
    """Train and eval prompts, each rendered once (data.max_prompt_len checked), and the train loader."""
    from megatron_specrl.data.datasets import DatasetError, PromptLoader, load_records, render_all

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
    return _Data(train_records, train_ids, eval_records, eval_ids, loader)


def start_actors(cfg: RunConfig, model: _Model, out: Path):
    """Ray, the placement of learner ranks and engines on its GPUs, the resync transport that placement
    allows, and the actors (actors.build_actors): (actors, placement, transport)."""
    from megatron_specrl.cluster.actors import build_actors, init_ray
    from megatron_specrl.run.overlap import split_cores

    binding = split_cores(cfg)   # trainer.max_staleness on CPU: the engines decode on cores of their own
    if binding:
        log.info("%s: engines bound to CPUs %s, learner ranks on the others", cfg.trainer.overlap_key(), binding)
    init_ray(cfg.ray)
    placement = plan_placement(cfg, cluster_gpus())
    transport = resolve_transport(cfg.trainer.resync_transport, placement, cfg.rollout.num_engines,
                                  cfg.rollout.engine)
    a = cfg.algorithm
    actors = build_actors(model.model_dir, cfg.learner, cfg.rollout, seed=cfg.trainer.seed,
                          log_dir=out / "engine_logs", critic_lr=a.critic_lr if a.name == "ppo" else None,
                          critic_lr_warmup_steps=a.critic_lr_warmup_steps, critic_weight_decay=a.critic_weight_decay,
                          critic_grad_clip=a.critic_grad_clip, reference=cfg.needs_reference,
                          learner_gpus_per_rank=placement.learner_gpus_per_rank,
                          gpus_per_engine=placement.gpus_per_engine)
    return actors, placement, transport


def reward_controller(cfg: RunConfig, state: dict | None) -> RewardKLController | None:
    """beta of the KL in the reward (algorithm.use_kl_in_reward), continued from the checkpoint's."""
    if not cfg.algorithm.use_kl_in_reward:
        return None
    k = cfg.algorithm.kl_ctrl
    reward_kl = RewardKLController(k.type, k.kl_coef, k.target_kl, k.horizon)
    if state is not None and "reward_kl" in state:
        reward_kl.load_state_dict(state["reward_kl"])
    return reward_kl


def load_tokenizer(model_path: str, model_dir: Path, hf_config: dict) -> PreTrainedTokenizerBase:
    """model.path's tokenizer, refused in one line where transformers cannot load one (a directory holding
    only weights and config.json) or where it has ids past the model's vocab_size (they would index past
    the embedding inside the learner and the engines)."""
    from transformers import AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:   # OSError / ValueError / TypeError, depending on what is missing
        from megatron_specrl.errors import quote_exception
        raise ConfigError(f"model.path={model_path!r}: cannot load its tokenizer ({quote_exception(e)}); the "
                          "directory needs tokenizer.json or tokenizer_config.json beside config.json") from None
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
