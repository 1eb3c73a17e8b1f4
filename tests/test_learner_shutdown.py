"""LearnerWorker.shutdown frees its model: nothing the worker holds keeps a parameter alive.

On an H200 (session 28) a bf16 learner left 4.7 GiB allocated after shutdown: its Float16Module kept
the model, DDP's fp32 grad buffers and the optimizer's fp32 master weights alive. Checked here on CPU
by weak references, in one spawned process for the three optimizer / precision settings."""

from __future__ import annotations

import json

import torch
from test_learner_layouts import complete_batch, loss_config, make_batch

from megatron_specrl.ports import free_port

SETTINGS = {"adamw_fp32": {}, "distributed_fp32": {"distributed_optimizer": True},
            "distributed_bf16": {"precision": "bfloat16", "distributed_optimizer": True}}


def _child(_rank, hf_dir, out):
    import gc
    import weakref

    from megatron_specrl.config import LearnerConfig
    from megatron_specrl.learner.worker import LearnerWorker

    batch = make_batch(hf_dir)
    full = complete_batch(batch, torch.zeros_like(batch["noise"]))
    alive = {}
    for tag, kw in SETTINGS.items():
        w = LearnerWorker(0, 1, "127.0.0.1", free_port(), LearnerConfig(micro_batch_size=2, loss=loss_config(), **kw))
        w.load_hf(hf_dir)
        w.train_step(full)
        refs = [weakref.ref(p) for p in w.model.parameters()] + [weakref.ref(w.model)]
        w.shutdown()
        gc.collect()
        alive[tag] = sum(r() is not None for r in refs)
    with open(out, "w") as f:
        json.dump(alive, f)


def test_shutdown_leaves_no_parameter_alive(tiny_llama, tmp_path):
    import torch.multiprocessing as mp
    out = tmp_path / "alive.json"
    mp.spawn(_child, args=(str(tiny_llama), str(out)), nprocs=1, join=True)
    assert json.loads(out.read_text()) == {tag: 0 for tag in SETTINGS}
