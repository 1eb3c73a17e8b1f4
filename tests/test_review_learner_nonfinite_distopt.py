"""learner.distributed_optimizer: a non-finite gradient must not reach the weights either.

Megatron's optimizer only detects inf / NaN through its fp16 loss scaler; with fp32 (or bf16) parameters
it has none, so optimizer.step() clips by a NaN norm (a no-op: NaN < 1 is false), steps Adam on the NaN
gradients and reports success. The worker must check the global grad norm itself, as the torch AdamW
path does (tests/test_learner_nonfinite.py), and raise without stepping.
"""

import pytest
import torch
import torch.multiprocessing as mp

from megatron_specrl.ports import free_port


def _child(rank, hf_dir, port, out):
    from megatron_specrl.config import LearnerConfig, LossConfig
    from megatron_specrl.learner.worker import LearnerWorker

    settings = LearnerConfig(micro_batch_size=2, recompute_old_logprobs=False, distributed_optimizer=True,
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
    # a finite batch afterwards still trains (the NaN gradients did not stay in DDP's buffers)
    batch["advantages"] = torch.nan_to_num(batch["advantages"])
    w.train_step(batch)
    trained = {n: p.detach().clone() for n, p in w.model.named_parameters()}
    torch.save({"error": error, "finite": all(torch.isfinite(p).all() for p in after.values()),
                "unchanged": all(torch.equal(before[n], after[n]) for n in before),
                "trained_finite": all(torch.isfinite(p).all() for p in trained.values()),
                "moved": any(not torch.equal(before[n], trained[n]) for n in before)}, out)
    w.shutdown()


@pytest.mark.slow
def test_nan_gradients_skip_the_megatron_step_and_raise(tiny_llama, tmp_path):
    out = tmp_path / "r.pt"
    mp.spawn(_child, args=(str(tiny_llama), free_port("127.0.0.1"), str(out)), nprocs=1, join=True)
    r = torch.load(out)
    assert r["finite"] and r["unchanged"], r
    assert r["error"] is not None and "non-finite" in r["error"], r
    assert r["trained_finite"] and r["moved"], r
