"""Everything a run holds between steps, built once (run.build): model dir, data, learner, engines,
store, logger, and the few things it does with them that are not the step (trainer.train_step)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from megatron_specrl.algorithms.kl_reward import RewardKLController
from megatron_specrl.config import RunConfig
from megatron_specrl.config.placement import Placement
from megatron_specrl.engines.protocol import RolloutEngine
from megatron_specrl.metrics.sinks import MetricsLogger, plot_metrics
from megatron_specrl.resync.routes import Route
from megatron_specrl.rollout.speculative import SpeculativeRollout
from megatron_specrl.rollout.store import TrajectoryStore

if TYPE_CHECKING:   # types only: these pull in Ray, transformers and the dataset readers
    from transformers import PreTrainedTokenizerBase

    from megatron_specrl.data.datasets import PromptLoader, PromptRecord
    from megatron_specrl.learner.group import LearnerGroup
    from megatron_specrl.rewards import RewardFn

log = logging.getLogger(__name__)


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

    def score(self, samples):
        """(rewards, filter values, metrics) of samples of this run's prompts, with its reward function
        (algorithms/rewards_step.score_samples): a rollout round's, and the exact overlap's refreshed batch."""
        from megatron_specrl.algorithms.rewards_step import score_samples
        return score_samples(samples, self.train_records, self.reward_fn, self.tokenizer, self.cfg.algorithm,
                             self.cfg.rollout.max_new_tokens)

    def record_data_order(self, step: int, samples) -> None:
        """Which prompts each step trained on: makes data order after a resume checkable."""
        import json
        ids = list(dict.fromkeys(s.prompt_id for s in samples))
        with open(self.out / "data_order.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "prompt_ids": ids}) + "\n")

    def finish(self) -> None:
        """End of run, after its final checkpoint (trainer.train saves it): HF export, plots."""
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
