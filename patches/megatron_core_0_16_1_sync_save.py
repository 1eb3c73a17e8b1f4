"""A synchronous dist-checkpoint save without a multiprocessing Manager (megatron-core 0.16.1).

Megatron's filesystem writer (`dist_checkpointing/strategies/filesystem_async.py`) hands its write
results back through a queue that it makes once per process with `mp.get_context("spawn").Manager()`,
so that an async save's persistent worker process can use it too. Our learner saves synchronously
(`async_sharded_save=False`): the writer runs in the saving process, which puts its results into
that queue and reads them back itself. The Manager it spawns for this re-imports the process's
`__main__` (a Ray worker's, in our learner actors) and cost 2.4-2.8 s of CPU at every learner
process's first save on the 2-core CI machine, times the ranks saving at once.

`in_process_results_queue()` gives the writer a plain in-process `queue.Queue` for the duration of a
synchronous save: the same put / get_nowait calls, the same files. It only seeds the module global
the writer reads (`_results_queue`) when no queue exists yet, and clears it afterwards, so an async
save later in the process still gets Megatron's own Manager queue. Another megatron-core version:
a null context (Megatron's own queue).
"""

from __future__ import annotations

import contextlib
import queue

VERSION = "0.16.1"


@contextlib.contextmanager
def in_process_results_queue():
    from megatron_specrl.patches import megatron_version
    if megatron_version() != VERSION:
        yield
        return
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    if filesystem_async._results_queue is not None:   # Megatron made its own (an async save ran): keep it
        yield
        return
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = None
