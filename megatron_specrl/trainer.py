"""The RL training loop. `train(cfg)` is the whole run; `train_step` is the whole step.

    batch of prompts -> speculative rollout -> rewards -> (DAPO filter) -> advantages
      -> learner train step -> weight resync -> log -> checkpoint -> eval
"""

from __future__ import annotations

import time

import torch

from megatron_specrl.run_setup import Run, build_run, evaluate, rollout_with_recovery, save_run_checkpoint
from megatron_specrl.algorithms.rewards_step import grpo_like_advantages
from megatron_specrl.algorithms.ppo import ppo_advantages
from megatron_specrl.config import RunConfig
from megatron_specrl.faults import maybe_kill
from megatron_specrl.rollout.batch import build_batch
from megatron_specrl.rollout.dynamic import collect_rollouts
from megatron_specrl.resync.lifecycle import engines_of


def train_step(run: Run, step: int) -> dict[str, float]:
    cfg, t0 = run.cfg, time.perf_counter()
    # 1-2. rollout (+ rewards and DAPO's dynamic sampling, which needs rewards to filter groups)
    maybe_kill("rollout", step)
    samples, rewards, metrics = rollout_with_recovery(run, step, collect_rollouts)
    run.record_data_order(step, samples)
    # 3. advantages
    if cfg.algorithm.name == "ppo":   # token-level advantages need the critic's values on the batch
        batch = build_batch(samples, torch.zeros(len(samples)), run.pad_id)
        metrics.update(ppo_advantages(run, batch, rewards))
    else:
        batch = build_batch(samples, grpo_like_advantages(samples, rewards, cfg), run.pad_id)
    # the learner's (and the reference's) log-probs are log_softmax(logits / T): the sampling temperature
    batch["temperature"] = cfg.rollout.temperature
    # (learner.recompute_old_logprobs: the policy scores the ratio's old log-probs inside its train
    # step, once, and reports train/rollout_learner_logprob_abs_diff)
    if run.ref is not None:   # KL anchor: the frozen initial policy's log-probs (learner.loss.kl_coef > 0)
        batch["ref_logprobs"] = run.ref.compute_logprobs(batch)
    # 4. learn
    t_train = time.perf_counter()
    maybe_kill("train", step)
    sleeping = run.placement.engines_sleep_during_training
    if sleeping:   # colocated: the learner gets the engines' GPU memory while it trains
        for e in engines_of(run.engine):
            e.release_memory()
    if run.critic is not None:
        metrics.update({f"critic/{k}": v for k, v in run.critic.train_step(batch).items()})
    metrics.update({f"train/{k}": v for k, v in run.learner.train_step(batch).items()})
    metrics["time/train_s"] = time.perf_counter() - t_train
    # 5. resync the engines to the new weights
    run.version += 1
    maybe_kill("resync", step)
    metrics.update(run.resync(wake_engines=sleeping))
    metrics["time/step_s"] = time.perf_counter() - t0
    metrics["weight_version"] = run.version
    return metrics


def train(cfg: RunConfig) -> Run:
    run = build_run(cfg)
    try:
        if cfg.trainer.eval_every and run.step == 0:   # the baseline every later eval is compared with
            run.logger.log(0, evaluate(run))
        with run.progress:
            task = run.progress.add_task("training", total=cfg.trainer.total_steps, completed=run.step)
            while run.step < cfg.trainer.total_steps:
                step = run.step + 1
                metrics = train_step(run, step)
                run.step = step
                if cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0:
                    metrics.update(evaluate(run))
                if cfg.trainer.check_resync_every and step % cfg.trainer.check_resync_every == 0:
                    from megatron_specrl.diagnostics.check import logprob_check
                    metrics.update(logprob_check(run.engine, run.learner, run.version, run.probe_prompts(),
                                                 min(32, cfg.rollout.max_new_tokens), run.pad_id))
                run.logger.log(step, metrics)
                if cfg.trainer.checkpoint_every and step % cfg.trainer.checkpoint_every == 0:
                    save_run_checkpoint(run)
                run.progress.update(task, completed=step)
        run.finish()
    finally:
        run.shutdown()
    return run

