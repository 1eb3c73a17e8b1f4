"""A run's checkpoints: which one to resume (find_resume) and whether it is this run's (check_resume),
loading it into the learners, store and engines, saving one, and whether its engines' draft trees are in it
(their save and restore: rollout/tree_drafting/checkpoint.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_specrl import checkpoint as ckpt
from megatron_specrl.config import ConfigError, RunConfig
from megatron_specrl.rollout.tree_drafting.checkpoint import restore_draft_trees, save_draft_trees
from megatron_specrl.rollout.dump import set_aside_later_dumps
from megatron_specrl.rollout.store import TrajectoryStore

if TYPE_CHECKING:
    from megatron_specrl.data.datasets import PromptLoader
    from megatron_specrl.learner.group import LearnerGroup
    from megatron_specrl.run.state import Run

log = logging.getLogger(__name__)


# -- resume ---------------------------------------------------------------------------------
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


def check_resume(cfg: RunConfig, out: Path, resume_from: Path | None, model_dir: Path, tokenizer_id: str,
                 loader: PromptLoader) -> dict | None:
    """The checkpoint's trainer state (None for a fresh run), refused in one line, before Ray and the
    actors start, where it is not this run's; the loader continues its data order. Sets aside what the
    abandoned run wrote past it (later checkpoints with its logs, rollout dumps)."""
    state = ckpt.load_state(resume_from) if resume_from else None
    aside = None   # where the abandoned run's later checkpoints went, if anywhere
    if state is not None:
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
    return state


def load_learners(resume_from: Path, state: dict, learner: LearnerGroup,
                  critic: LearnerGroup | None) -> tuple[TrajectoryStore, int, int]:
    """The checkpoint into the learner (and critic): (its trajectory store, step, weight version)."""
    learner.load_checkpoint(str(resume_from / "learner"))
    if critic is not None:
        critic.load_checkpoint(str(resume_from / "critic"))
    return TrajectoryStore.load(resume_from), state["step"], state["weight_version"]


def resume_engines(run: Run, resume_from: Path) -> None:
    """The engines started from the HF weights: give them the checkpoint's, and its draft trees."""
    run.resync()
    if drafts_with_trees(run):   # a run resumed with rollout.draft=none leaves the saved trees alone
        restore_draft_trees(run.engine, resume_from / "draft_trees")
    log.warning("resumed from %s at step %d (weight version %d, %d stored trajectories)",
                resume_from, run.step, run.version, len(run.store))


# -- save -----------------------------------------------------------------------------------
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


def save_final_checkpoint(run: Run) -> Path | None:
    """The last step's checkpoint at the end of a run, unless trainer.checkpoint_every is off or just
    saved that step; None when nothing was saved."""
    if not run.cfg.trainer.checkpoint_every or (run.out / "checkpoints" / ckpt.step_dir_name(run.step)).exists():
        return None
    return save_run_checkpoint(run)


# -- draft trees ----------------------------------------------------------------------------
def drafts_with_trees(run: Run) -> bool:
    """Whether this run's engines hold draft trees (rollout.draft=tree). A checkpoint written with
    trees can be resumed with drafting off: its engines refuse trees (load_draft_state raises)."""
    return run.cfg.rollout.draft == "tree"
