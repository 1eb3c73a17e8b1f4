"""A non-finite gradient must not reach the weights (torch AdamW path, the default learner optimizer).

A NaN reward (a user's reward function) makes its group's advantages NaN, and so the loss and every
gradient. AdamW stepped on them turns every weight NaN for the rest of the run, silently; Megatron's
optimizer (learner.distributed_optimizer) skips such a step and the worker raises. Both paths now
leave the weights as they were and raise.
"""

import pytest
import torch
import torch.multiprocessing as mp

from megatron_specrl.ports import free_port


def _child(rank, hf_dir, port, out):
    from megatron_specrl.config import LearnerConfig, LossConfig
    from megatron_specrl.learner.worker import LearnerWorker

    w = LearnerWorker(0, 1, "127.0.0.1", port, LearnerConfig(micro_batch_size=2, recompute_old_logprobs=False,
                                                              loss=LossConfig(tis="off")), seed=1)
    w.load_hf(hf_dir)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (4, 10), generator=g)
    mask = torch.zeros(4, 10)
    mask[:, 4:] = 1
    adv = torch.tensor([1.0, -1.0, float("nan"), 0.5])[:, None] * mask
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask,
             "advantages": torch.where(mask.bool(), adv, torch.zeros_like(adv))}
    batch["rollout_logprobs"] = w.compute_logprobs(batch) * mask
    before = {n: p.detach().clone() for n, p in w.model.named_parameters()}
    error = None
    try:
        w.train_step(batch)
    except RuntimeError as e:
        error = str(e)
    after = {n: p.detach().clone() for n, p in w.model.named_parameters()}
    torch.save({"error": error, "finite": all(torch.isfinite(p).all() for p in after.values()),
                "unchanged": all(torch.equal(before[n], after[n]) for n in before)}, out)
    w.shutdown()


@pytest.mark.slow
def test_nan_gradients_skip_the_adamw_step_and_raise(tiny_llama, tmp_path):
    out = tmp_path / "r.pt"
    mp.spawn(_child, args=(str(tiny_llama), free_port("127.0.0.1"), str(out)), nprocs=1, join=True)
    r = torch.load(out)
    assert r["finite"] and r["unchanged"], r
    assert r["error"] is not None and "non-finite" in r["error"], r
