"""A synchronous learner checkpoint save starts no multiprocessing Manager
(patches/megatron_core_0_16_1_sync_save.py): Megatron's writer made one per process, 2.4-2.8 s at
each learner process's first save on this machine."""

import contextlib
import queue

import pytest
import torch
import torch.multiprocessing as mp

from megatron_specrl.ports import free_port


def test_the_queue_is_seeded_for_the_save_only_and_megatrons_own_is_kept():
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    from patches.megatron_core_0_16_1_sync_save import in_process_results_queue
    assert fa._results_queue is None
    with in_process_results_queue():
        q = fa._get_write_results_queue()
        assert isinstance(q, queue.Queue)
        q.put({"rank": 0})              # the writer's put and the reader's get_nowait, in one process
        assert q.get_nowait() == {"rank": 0}
    assert fa._results_queue is None    # an async save later still makes Megatron's Manager queue
    theirs = object()
    fa._results_queue = theirs          # one already made (an async save ran): left as it is
    try:
        with in_process_results_queue():
            assert fa._get_write_results_queue() is theirs
        assert fa._results_queue is theirs
    finally:
        fa._results_queue = None


def _save_load_child(rank, port, out, use_queue):
    """World-1 gloo group; a Manager start raises; save a sharded state dict and load it back."""
    import multiprocessing.managers

    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    import patches
    from patches.megatron_core_0_16_1_sync_save import in_process_results_queue

    def no_manager(self, *a, **k):
        raise RuntimeError("a multiprocessing Manager was started")
    multiprocessing.managers.SyncManager.start = no_manager
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    weights = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = {"w": ShardedTensor.from_rank_offsets("w", weights.clone())}
    result = {}
    try:
        ctx = in_process_results_queue() if use_queue else contextlib.nullcontext()
        with patches.cuda_to_cpu(), ctx:   # as the learner saves on CPU (its writer syncs "the GPU")
            dist_checkpointing.save(state, out, async_sharded_save=False)
        loaded = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4))}, out)
        result["equal"] = bool(torch.equal(loaded["w"], weights))
    except RuntimeError as e:
        result["error"] = str(e)
    dist.destroy_process_group()
    torch.save(result, f"{out}.result")


@pytest.mark.parametrize("use_queue", [True, False])
def test_a_synchronous_save_round_trips_without_a_manager(tmp_path, use_queue):
    out = tmp_path / "ckpt"
    out.mkdir()
    mp.spawn(_save_load_child, args=(free_port("127.0.0.1"), str(out), use_queue), nprocs=1, join=True)
    result = torch.load(f"{out}.result")
    if use_queue:
        assert result == {"equal": True}
    else:   # Megatron's own path needs the Manager: the check above is a real one
        assert "Manager was started" in result.get("error", "")
