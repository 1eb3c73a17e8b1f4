"""A synchronous learner checkpoint save starts no multiprocessing Manager

The tests of this subject that start processes or engines; the rest are in tests/unit/learner/test_checkpoint_save.py.
"""

import contextlib
import pytest
import torch
import torch.multiprocessing as mp
from megatron_specrl.learner.ports import free_port


def _save_load_child(rank, port, out, use_queue):
    """World-1 gloo group; a Manager start raises; save a sharded state dict and load it back."""
    import multiprocessing.managers

    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    from megatron_specrl import patches
    from megatron_specrl.patches.megatron_core_0_16_1_sync_save import in_process_results_queue

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


