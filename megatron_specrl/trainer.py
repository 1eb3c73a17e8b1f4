"""The RL training loop. `train(cfg)` is the whole run; `train_step` is the whole step.

    prompts -> speculative rollout -> rewards -> (DAPO filter) -> advantages
      -> learner train step -> weight resync -> log -> checkpoint -> eval
"""

from __future__ import annotations

import time

import torch

from megatron_specrl import faults
from megatron_specrl.algorithms.advantages import grpo_advantages, terminal_rewards
from megatron_specrl.algorithms.kl_reward import kl_cost
from megatron_specrl.algorithms.ppo import ppo_advantages
from megatron_specrl.algorithms.rewards_step import group_ids_of
from megatron_specrl.config import RunConfig
from megatron_specrl.config.resolve import log_resolved, resolve
from megatron_specrl.resync.lifecycle import engines_of, release_engine_memory
from megatron_specrl.rollout.batch import build_batch
from megatron_specrl.rollout.dump import dump_rollouts
from megatron_specrl.rollout.dynamic import filter_rounds
from megatron_specrl.run.build import build_run
from megatron_specrl.run.checkpointing import save_final_checkpoint, save_run_checkpoint
from megatron_specrl.run.evaluation import evaluate
from megatron_specrl.run.overlap import (
    Collected, RolloutAhead, refresh_rollout, staleness, starts_ahead, step_times, timed_collect,
)
from megatron_specrl.run.recovery import collect_again, resync_with_recovery, with_engine_recovery
from megatron_specrl.run.state import Run


def train_step(run: Run, step: int, hooks: faults.PhaseHooks = faults.PhaseHooks(),
               ahead: RolloutAhead | None = None) -> dict[str, float]:
    t0 = time.perf_counter()
    hooks.before("rollout", step)
    # 1-3. generate and reward (DAPO: rounds until enough informative groups): the rollout that ran beside
    #      the previous step's training (trainer.overlap; exact: refreshed, then DAPO's filter), or one now;
    #      a dead engine: restart, retry once
    got = take_rollout(run, step, ahead, hooks)
    samples, rewards, metrics = got.samples, got.rewards, got.metrics
    run.record_data_order(step, samples)
    if run.cfg.trainer.rollout_data_dir:   # verl's rollout dump: the step's samples and rewards as JSON lines
        dump_rollouts(run.cfg.trainer.rollout_data_dir, step, samples, rewards.tolist(), run.tokenizer)
    batch = build_batch(samples, torch.zeros(len(samples)), run.pad_id)
    batch["temperature"] = run.cfg.rollout.temperature   # learner log-probs are log_softmax(logits / T)
    metrics.update(advantages(run, batch, samples, rewards))          # 4. advantages (and the KL in the reward)
    if ahead is not None and starts_ahead(run.cfg, step):   # the next step's rollout beside this train step
        ahead.start(run, step + 1, lambda: collect_ahead(run, step + 1))
    hooks.before("train", step)
    sleeping = run.placement.engines_sleep_during_training
    metrics.update(learn(run, batch, release_engines=sleeping))       # 5. the learners' step
    next_rollout = ahead.wait() if ahead is not None else None        # engines change weights between batches only
    # 6. resync the engines to the new weights (and wake them first if they slept); an engine that dies
    #    on the way is restarted and synced again
    metrics.update(staleness(run.version, got.version))
    run.version += 1
    hooks.before("resync", step)
    metrics.update(resync_with_recovery(run, step, wake_engines=sleeping))
    metrics.update(step_times(t0, time.perf_counter(), got, next_rollout, metrics["time/train_s"]))
    metrics["weight_version"] = run.version
    return metrics


def take_rollout(run: Run, step: int, ahead: RolloutAhead | None,
                 hooks: faults.PhaseHooks = faults.PhaseHooks()) -> Collected:
    """The step's rollout: the one in flight for it (trainer.overlap=exact: refreshed under the engines'
    weights, then DAPO's filter), else one collected now under the engines' weights."""
    if ahead is not None and ahead.holds(step):
        refresh = ((lambda got: refresh_and_filter(run, step, got, hooks)) if run.cfg.trainer.overlap_mode == "exact"
                   else None)
        return ahead.take(run, step, lambda state: Collected(*collect_again(run, step, state, lambda: collect(run, step)),
                                                             version=run.version), refresh)
    return timed_collect(lambda: with_engine_recovery(run, step, lambda: collect(run, step)), run.version)


def refresh_and_filter(run: Run, step: int, got: Collected,
                       hooks: faults.PhaseHooks = faults.PhaseHooks()) -> Collected:
    """The exact overlap's batch: the first round generated ahead, refreshed under the current weights; with
    DAPO's dynamic sampling, then filtered on its refreshed rewards, and filled with further rounds generated
    now, under the same (current) weights: the filter must judge the groups the step trains on, not their
    stale versions. Logs time/fill_rounds_s (the filter and its rounds)."""
    got = refresh_rollout(run, step, got, hooks)
    if not run.cfg.algorithm.dynamic_sampling:
        return got
    t0 = time.perf_counter()
    samples, rewards, metrics = collect(run, step, first=got)
    metrics["time/fill_rounds_s"] = time.perf_counter() - t0
    return Collected(samples, rewards, metrics, run.version, got.started, got.finished)


def rollout_round(run: Run, step: int, i: int):
    """Round i of the step: the loader's next prompts (gen_prompts_per_step) -> rollout.n_samples samples
    each, under the engines' weights (run.version) -> (samples, rewards, filter values, metrics)."""
    cfg = run.cfg
    prompts = run.next_prompts()
    upcoming = run.upcoming_prompts() if cfg.rollout.runahead else []   # run-ahead feeds their draft trees
    samples, metrics = run.rollout.run(prompts, cfg.rollout.n_samples, run.version, step=f"{step}.{i}",
                                       next_prompts=upcoming)
    rewards, filter_values, reward_metrics = run.score(samples)
    return samples, rewards, filter_values, {**metrics, **reward_metrics}


def collect(run: Run, step: int, first: Collected | None = None):
    """(samples, rewards, metrics) of the step: one rollout round, or DAPO's filter of rounds until
    trainer.prompts_per_step groups are informative. `first`: round 0, collected already and scored with
    its filter values (the exact overlap's refreshed batch, refresh_and_filter); the rounds after it are
    generated here, so the synchronous loop and the exact overlap filter alike."""
    cfg, alg = run.cfg, run.cfg.algorithm

    def one_round(i: int):
        if i == 0 and first is not None:
            return first.samples, first.rewards, first.filter_values, first.metrics
        return rollout_round(run, step, i)

    if alg.dynamic_sampling:
        return filter_rounds(one_round, cfg.trainer.prompts_per_step, alg.max_sampling_tries)
    samples, rewards, _, metrics = one_round(0)
    return samples, rewards, metrics


def collect_ahead(run: Run, step: int):
    """The rollout that runs beside the previous step's training: the whole step's (the stale overlap:
    DAPO's rounds too, all under the old weights), or the exact overlap's first round alone, which
    refresh_and_filter refreshes and only then filters (DAPO) and fills under the new weights."""
    if run.cfg.trainer.overlap_mode == "exact":
        samples, rewards, _, metrics = rollout_round(run, step, 0)
        return samples, rewards, metrics
    return collect(run, step)


def advantages(run: Run, batch: dict, samples, rewards: torch.Tensor) -> dict[str, float]:
    """Per sample, group-relative (GRPO, DAPO), or per token from the critic (PPO), on the task rewards
    less beta x KL(policy || reference) per token where use_kl_in_reward is on; into `batch`."""
    cfg, alg, metrics = run.cfg, run.cfg.algorithm, {}
    if run.ref is not None:   # KL anchor: the frozen initial policy's log-probs (RunConfig.needs_reference)
        batch["ref_logprobs"] = run.ref.compute_logprobs(batch)
    kl_in_reward = torch.zeros_like(batch["loss_mask"])
    if alg.use_kl_in_reward:   # KL of the policy that sampled the batch: the PPO ratio's old log-probs
        if cfg.learner.recompute_old_logprobs:   # scored here, before the rewards need them, not in train_step
            batch["old_logprobs"], batch["old_logprobs_scored"] = run.learner.compute_logprobs(batch), True
        kl_in_reward, kl_metrics = kl_cost(batch["old_logprobs"], batch["ref_logprobs"], batch["loss_mask"],
                                           run.reward_kl, alg.kl_penalty)
        metrics.update(kl_metrics)
    if alg.name == "ppo":
        token_rewards = terminal_rewards(rewards, batch["loss_mask"]) - kl_in_reward
        metrics.update(ppo_advantages(run.critic, batch, token_rewards, alg.gamma, alg.lam))
    else:
        adv = grpo_advantages(rewards - kl_in_reward.sum(-1), group_ids_of(samples), normalize_std=alg.normalize_std)
        batch["advantages"] = adv[:, None] * batch["loss_mask"]
    return metrics


def learn(run: Run, batch: dict, release_engines: bool) -> dict[str, float]:
    """The critic's and the policy's train step (old log-probs for the ratio are scored inside, once, with
    learner.recompute_old_logprobs); `release_engines`: colocated on GPUs, the learner gets the engines'
    memory while it trains."""
    t_train, metrics = time.perf_counter(), {}
    if release_engines:
        release_engine_memory(run.engine)
    if run.critic is not None:
        metrics.update({f"critic/{k}": v for k, v in run.critic.train_step(batch).items()})
    metrics.update({f"train/{k}": v for k, v in run.learner.train_step(batch).items()})
    metrics["time/train_s"] = time.perf_counter() - t_train
    return metrics


def train(cfg: RunConfig) -> Run:
    """The whole run. `cfg`: the resolved config (the CLI resolves it for its plan and dry run), or one
    from load_config, which the resolve step turns into it here (the Python API); either way it is
    resolved once, and its auto values and experimental features are logged once."""
    if not cfg.is_resolved:
        cfg = resolve(cfg)
    log_resolved(cfg)
    run = build_run(cfg)
    cfg = run.cfg   # the same config, with rollout.draft_model located (run.build.prepare_model)
    hooks = faults.from_env(engines=lambda: engines_of(run.engine))   # crash tests only; no-op otherwise
    ahead = None
    try:
        if cfg.trainer.eval_every and run.step == 0:   # the baseline every later eval is compared with
            run.logger.log(0, evaluate(run))
        ahead = RolloutAhead() if cfg.trainer.runs_ahead else None   # the rollout in flight, if any
        with run.progress:
            task = run.progress.add_task("training", total=cfg.trainer.total_steps, completed=run.step)
            while run.step < cfg.trainer.total_steps:
                step = run.step + 1
                metrics = train_step(run, step, hooks, ahead)
                run.step = step
                if cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0:
                    metrics.update(evaluate(run))
                if cfg.trainer.check_resync_every and step % cfg.trainer.check_resync_every == 0:
                    from megatron_specrl.diagnostics.check import logprob_check
                    metrics.update(logprob_check(run.engine, run.learner, run.version, run.probe_prompts(),
                                                 min(32, cfg.rollout.max_new_tokens), run.pad_id,
                                                 cfg.rollout.engine_dtype))
                run.logger.log(step, metrics)
                if cfg.trainer.checkpoint_every and step % cfg.trainer.checkpoint_every == 0:
                    hooks.before("checkpoint", step)
                    save_run_checkpoint(run)
                run.progress.update(task, completed=step)
        save_final_checkpoint(run)
        run.finish()
    finally:
        if ahead is not None:
            ahead.shutdown()
        run.shutdown()
    return run
