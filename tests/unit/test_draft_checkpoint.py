"""Draft trees travel with checkpoints: rollout/tree_drafting/checkpoint.save_draft_trees / restore_draft_trees.
"""

import pytest
from megatron_specrl.rollout.tree_drafting.trees import DraftTrees
from megatron_specrl.rollout.store import TrajectoryStore
from megatron_specrl.engines.protocol import RoutesToEngines
from megatron_specrl.rollout.tree_drafting.checkpoint import restore_draft_trees, save_draft_trees
from tests.helpers.capabilities import DraftsNothing


class FakeEngine(DraftsNothing):
    """Holds trees the way the vLLM engine's proposer does, behind the same three calls."""

    def __init__(self, trees=None):
        self.trees = trees

    def draft_state(self):
        return None if self.trees is None else self.trees.state_dict()

    def load_draft_state(self, state):
        self.trees = DraftTrees.from_state_dict(state)


class FakeRouter(DraftsNothing, RoutesToEngines):
    def __init__(self, engines):
        self.engines = engines

    def draft_state(self):
        return {"engines": [e.draft_state() for e in self.engines]}

    def load_draft_state(self, state):
        for e, s in zip(self.engines, state["engines"]):
            e.load_draft_state(s)


def _trees(seq):
    t = DraftTrees(max_depth=12, max_match=4)
    t.insert("p", seq)
    return t


def _proposal(trees, prefix):
    trees.start("r", "p", prefix)
    return trees.propose("r", 8, 0.0)


def test_single_engine_round_trip(tmp_path):
    save_draft_trees(FakeEngine(_trees([1, 2, 3, 4, 5, 6, 7])), tmp_path / "draft_trees")
    fresh = FakeEngine()
    restore_draft_trees(fresh, tmp_path / "draft_trees")
    assert _proposal(fresh.trees, [2, 3]) == [4, 5, 6, 7]


def test_router_round_trip_keeps_engine_order(tmp_path):
    router = FakeRouter([FakeEngine(_trees([1, 2, 3, 4])), FakeEngine(_trees([1, 2, 9, 9]))])
    save_draft_trees(router, tmp_path / "draft_trees")
    fresh = FakeRouter([FakeEngine(), FakeEngine()])
    restore_draft_trees(fresh, tmp_path / "draft_trees")
    assert _proposal(fresh.engines[0].trees, [1, 2]) == [3, 4]
    assert _proposal(fresh.engines[1].trees, [1, 2]) == [9, 9]


def test_no_trees_writes_and_restores_nothing(tmp_path):
    save_draft_trees(FakeEngine(None), tmp_path / "draft_trees")
    assert not (tmp_path / "draft_trees").exists()
    untouched = FakeEngine()
    restore_draft_trees(untouched, tmp_path / "draft_trees")     # an older checkpoint: no directory
    assert untouched.trees is None


def test_corrupt_trees_name_the_directory(tmp_path):
    save_draft_trees(FakeEngine(_trees([1, 2, 3])), tmp_path / "draft_trees")
    (tmp_path / "draft_trees" / "engine-0" / "draft_trees.json").write_text("{not json")
    with pytest.raises(RuntimeError, match="engine-0.*missing or corrupt"):
        restore_draft_trees(FakeEngine(), tmp_path / "draft_trees")


class RestartingEngine(FakeEngine):
    """An engine whose restart, like a real one's, comes back with empty trees."""

    def restart(self):
        self.trees = None


def test_engine_restart_reloads_the_trees_of_the_newest_checkpoint(tmp_path):
    """with_engine_recovery: the engines restarted after a failure draft from the newest
    checkpoint's trees instead of starting from nothing."""
    from types import SimpleNamespace

    from megatron_specrl import checkpoint as ckpt
    from megatron_specrl.data.datasets import PromptLoader, PromptRecord

    tmp = ckpt.begin(tmp_path / "checkpoints", 4)
    save_draft_trees(FakeRouter([FakeEngine(_trees([1, 2, 3, 4])), FakeEngine(_trees([5, 6, 7]))]),
                     tmp / "draft_trees")
    ckpt.commit(tmp, {"step": 4}, keep=2)
    router = FakeRouter([RestartingEngine(_trees([1, 2, 9])), RestartingEngine(_trees([5, 6, 9]))])
    records = [PromptRecord(id=str(i), prompt=f"p{i}", answer="0", meta={}) for i in range(4)]
    run = SimpleNamespace(cfg=SimpleNamespace(rollout=SimpleNamespace(draft="tree")),
                          engine=router, version=0, out=tmp_path, loader=PromptLoader(records, 2, seed=0),
                          store=TrajectoryStore())
    calls, metrics = _recover_once(run)
    assert metrics["engine/restarts"] == 1.0 and calls[0] == calls[1]     # same prompts again
    assert _proposal(router.engines[0].trees, [1, 2]) == [3, 4]          # the checkpoint's, not [9] nor nothing
    assert _proposal(router.engines[1].trees, [5, 6]) == [7]


def _recover_once(run):
    """The step's rollout fails once (a dead engine) and with_engine_recovery collects it again:
    (the batches each attempt drew, the step's metrics)."""
    from megatron_specrl.engines.protocol import EngineError
    from megatron_specrl.run.recovery import with_engine_recovery

    calls = []

    def collect():
        calls.append(run.loader.next_batch())
        if len(calls) == 1:
            raise EngineError("died", "fake")
        return [], None, {}

    _, _, metrics = with_engine_recovery(run, 5, collect)
    return calls, metrics


@pytest.mark.parametrize("impl", ["python", "compiled"])
def test_resumed_drafter_keeps_its_own_settings(tmp_path, impl):
    """A run resumed with other draft settings (here a smaller draft_max_nodes, longer drafts and a
    shorter match) loads the checkpoint's trees under its settings, not the crashed run's."""
    from megatron_specrl.rollout.tree_drafting.drafter import TreeDrafter

    old = TreeDrafter(4, 4096, {"impl": impl, "max_nodes": 100_000, "max_match": 4, "shared_nodes": 0})
    for key in ("p0", "p1", "p2"):                    # 31 states each
        old.trees.insert(key, [7] + list(range(30)))
    DraftTrees.save_state(old.state_dict(), tmp_path / "engine-0")
    new = TreeDrafter(16, 4096, {"impl": impl, "max_nodes": 70, "max_match": 8, "shared_nodes": 0})
    new.load_state_dict(DraftTrees.load_state(tmp_path / "engine-0"))
    assert type(new.trees) is type(TreeDrafter(16, 4096, {"impl": impl}).trees)
    assert (new.trees.max_nodes, new.trees.max_match, new.trees.max_depth) == (70, 8, 24)
    assert new.trees.stats()["nodes"] == 62 and new.trees.keys() == ["p1", "p2"]   # the oldest key left
    new.trees.start("r", "p2", [7])
    # a 1-token match drafts 16 tokens within depth 24 (the checkpoint's depth 8 would allow 7)
    assert new.trees.propose("r", 16, 0.0) == list(range(16))


class NonDraftingEngine(RestartingEngine):
    """An engine of a run with rollout.draft=none: like the real ones, it refuses trees."""

    def load_draft_state(self, state):
        raise ValueError("engine was built without tree drafting (rollout.draft=none)")


def test_a_run_resumed_with_drafting_off_ignores_the_checkpoint_trees(tmp_path):
    """Trees saved by a drafting run must not stop a run resumed with rollout.draft=none: its
    engines, restarted after a failure, come back without loading them."""
    from types import SimpleNamespace

    from megatron_specrl import checkpoint as ckpt
    from megatron_specrl.data.datasets import PromptLoader, PromptRecord

    tmp = ckpt.begin(tmp_path / "checkpoints", 4)
    save_draft_trees(FakeEngine(_trees([1, 2, 3, 4])), tmp / "draft_trees")
    ckpt.commit(tmp, {"step": 4}, keep=2)
    records = [PromptRecord(id=str(i), prompt=f"p{i}", answer="0", meta={}) for i in range(4)]
    cfg = SimpleNamespace(rollout=SimpleNamespace(draft="none"))
    run = SimpleNamespace(cfg=cfg, engine=NonDraftingEngine(), version=0, out=tmp_path,
                          loader=PromptLoader(records, 2, seed=0), store=TrajectoryStore())
    calls, metrics = _recover_once(run)
    assert metrics["engine/restarts"] == 1.0 and run.engine.trees is None
