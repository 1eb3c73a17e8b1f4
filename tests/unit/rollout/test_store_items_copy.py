"""TrajectoryStore's public iteration and copy (rollout/store.py)."""

from megatron_specrl.rollout.store import Trajectory, TrajectoryStore


def _t(tokens, version=0):
    return Trajectory(list(tokens), [-0.5] * len(tokens), "stop", version)


def test_items_in_put_order_and_copy_is_independent(tmp_path):
    store = TrajectoryStore()
    store.put("b", 1, _t([3, 4]))
    store.put("a", 0, _t([5]))
    store.put("b", 1, _t([6], version=1))            # replaced in place: keeps its first position
    assert [k for k, _ in store.items()] == [("b", 1), ("a", 0)]
    assert dict(store.items())[("b", 1)].token_ids == [6]

    twin = store.copy()
    twin.put("c", 2, _t([7]))
    store.begin_step()
    store.put("a", 0, _t([8]))
    assert dict(twin.items())[("a", 0)].token_ids == [5] and len(store) == 2 and len(twin) == 3
    twin.undo_step()                                  # no step of its own: nothing to undo
    assert len(twin) == 3

    store.save(tmp_path)
    assert list(TrajectoryStore.load(tmp_path).items()) == list(store.items())


def test_items_while_putting():
    """items() is a snapshot: putting while iterating it is allowed."""
    store = TrajectoryStore()
    store.put("a", 0, _t([1]))
    for (pid, k), t in store.items():
        store.put(pid, k + 1, t)
    assert len(store) == 2
