"""The engines' draft trees in a run's checkpoint: one directory per engine, written from and loaded into
the engines through the DraftsFromTrees capability (engines/protocol.py), in the trees' own file format
(trees.DraftTrees.save_state / load_state), so that a resumed run drafts as well as before it stopped.
Which run holds trees, and where in its checkpoint, is the run's (run/checkpointing.py)."""

from __future__ import annotations

from pathlib import Path

from megatron_specrl.engines.protocol import DraftsFromTrees, RoutesToEngines
from megatron_specrl.rollout.tree_drafting.trees import DraftTrees

ENGINE_TREES = "engine-{}"   # one directory per engine, by its index in the router (0 without one)


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
