"""A dead engine mid-run: restart every engine, push the learner's weights again, and retry what failed
once (a second failure ends the run: launch requeues it, resume continues from the newest checkpoint)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, TypeVar

from megatron_specrl import checkpoint as ckpt
from megatron_specrl.rollout.tree_drafting.checkpoint import restore_draft_trees
from megatron_specrl.run.checkpointing import drafts_with_trees

if TYPE_CHECKING:
    from megatron_specrl.run.state import Run

log = logging.getLogger(__name__)
T = TypeVar("T")


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


def collect_again(run: Run, step: int, loader_state: dict, collect: Callable[[], tuple[list, T, dict]]) -> tuple[list, T, dict]:
    """A rollout that ran ahead (trainer.max_staleness) and lost an engine: restart the engines with the
    learner's current weights, rewind the loader and the store to where that rollout started, collect again."""
    log.warning("rollout of step %d failed while the learner trained; restarting the engines at weight version %d",
                step, run.version)
    restart_engines(run, resync=run.version > 0)
    run.loader.load_state_dict(loader_state)
    run.store.undo_step()
    samples, rewards, metrics = collect()
    metrics["engine/restarts"] = 1.0
    return samples, rewards, metrics
