"""A non-finite gradient must not reach the weights, on either learner optimizer.

A NaN reward (a user's reward function) makes its group's advantages NaN, and so the loss and every
gradient. An optimizer stepped on them turns every weight NaN for the rest of the run, silently: torch
AdamW does, and so does Megatron's (learner.distributed_optimizer), which detects inf / NaN only through
an fp16 loss scaler and, with fp32 parameters, clips by a NaN norm (a no-op) and reports success. The
worker checks the global grad norm itself on both paths: the weights stay as they were, it raises, and
a finite batch afterwards still trains (no NaN left in the gradient buffers).
"""

import pytest
import torch
import torch.multiprocessing as mp

from megatron_specrl.ports import free_port


def _child(rank, hf_dir, port, out, distributed):
    from megatron_specrl.config import LearnerConfig, LossConfig
    from megatron_specrl.learner.worker import LearnerWorker

    settings = LearnerConfig(micro_batch_size=2, recompute_old_logprobs=False, distributed_optimizer=distributed,
                             loss=LossConfig(tis="off"))
    w = LearnerWorker(0, 1, "127.0.0.1", port, settings, seed=1)
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
    batch["advantages"] = torch.nan_to_num(batch["advantages"])
    w.train_step(batch)
    trained = {n: p.detach().clone() for n, p in w.model.named_parameters()}
    torch.save({"error": error, "finite": all(torch.isfinite(p).all() for p in after.values()),
                "unchanged": all(torch.equal(before[n], after[n]) for n in before),
                "trained_finite": all(torch.isfinite(p).all() for p in trained.values()),
                "moved": any(not torch.equal(before[n], trained[n]) for n in before)}, out)
    w.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("distributed", [False, True], ids=["adamw", "megatron-distributed"])
def test_nan_gradients_skip_the_step_and_raise(tiny_llama, tmp_path, distributed):
    out = tmp_path / "r.pt"
    mp.spawn(_child, args=(str(tiny_llama), free_port("127.0.0.1"), str(out), distributed), nprocs=1, join=True)
    r = torch.load(out)
    assert r["finite"] and r["unchanged"], r
    assert r["error"] is not None and "non-finite" in r["error"], r
    assert r["trained_finite"] and r["moved"], r
