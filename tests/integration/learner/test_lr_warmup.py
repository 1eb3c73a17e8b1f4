"""learner.lr_warmup_steps (verl's optim.lr_warmup_steps, 10 in its DAPO recipe): the lr rises linearly
over the first training steps as verl's constant schedule with warm-up (k / warmup at step k from 0),
on both optimizers, and a resumed learner continues the warm-up where its checkpoint left it.
"""

import pytest
import torch
import torch.multiprocessing as mp
from megatron_specrl.learner.ports import free_port

LR = 1e-3


def _batch(w):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (4, 10), generator=g)
    mask = torch.zeros(4, 10)
    mask[:, 4:] = 1
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask,
             "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None] * mask}
    batch["rollout_logprobs"] = w.compute_logprobs(batch) * mask
    return batch


def _child(rank, hf_dir, port, ckpt, out, distributed, resume):
    from megatron_specrl.config import LearnerConfig, LossConfig
    from megatron_specrl.learner.worker import LearnerWorker

    settings = LearnerConfig(micro_batch_size=4, recompute_old_logprobs=False, distributed_optimizer=distributed,
                             lr=LR, lr_warmup_steps=2, loss=LossConfig(tis="off"))
    w = LearnerWorker(0, 1, "127.0.0.1", port, settings, seed=1)
    w.load_hf(hf_dir)
    if resume:
        w.load_checkpoint(ckpt)
    batch = _batch(w)
    lrs, moved = [], []
    for i in range(1 if resume else 3):
        before = {n: p.detach().clone() for n, p in w.model.named_parameters()}
        lrs.append(w.train_step(batch)["lr"])
        moved.append(any(not torch.equal(before[n], p) for n, p in w.model.named_parameters()))
        if i == 0 and not resume:
            w.save_checkpoint(ckpt)
    torch.save({"lrs": lrs, "moved": moved}, out)
    w.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("distributed", [False, True])
def test_lr_warms_up_linearly_and_resumes_where_it_was(tiny_llama, tmp_path, distributed):
    ckpt, out = tmp_path / "ckpt", tmp_path / "r.pt"
    mp.spawn(_child, args=(str(tiny_llama), free_port("127.0.0.1"), str(ckpt), str(out), distributed, False),
             nprocs=1, join=True)
    r = torch.load(out)
    assert r["lrs"] == [0.0, LR / 2, LR] and r["moved"] == [False, True, True], r
    mp.spawn(_child, args=(str(tiny_llama), free_port("127.0.0.1"), str(ckpt), str(out), distributed, True),
             nprocs=1, join=True)
    assert torch.load(out)["lrs"] == [LR / 2]     # the step after the checkpoint's: k = 1
