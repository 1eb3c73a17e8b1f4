"""A synchronous learner checkpoint save starts no multiprocessing Manager
(patches/megatron_core_0_16_1_sync_save.py): Megatron's writer made one per process, 2.4-2.8 s at
each learner process's first save on this machine.
"""

import queue

def test_the_queue_is_seeded_for_the_save_only_and_megatrons_own_is_kept():
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    from megatron_specrl.patches.megatron_core_0_16_1_sync_save import in_process_results_queue
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




