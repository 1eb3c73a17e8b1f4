"""PPO's critic: the same Megatron stack with a value head; values are per token and it learns returns.
"""

import pytest
import torch
import torch.multiprocessing as mp
from megatron_specrl.learner.ports import free_port

def _critic_child(rank, hf_dir, port, out):
    from megatron_specrl.config import LearnerConfig
    from megatron_specrl.learner.worker import LearnerWorker

    w = LearnerWorker(0, 1, "127.0.0.1", port, LearnerConfig(lr=3e-3, micro_batch_size=4), seed=1, role="critic")
    w.load_hf(hf_dir)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (4, 10), generator=g)
    mask = torch.zeros(4, 10)
    mask[:, 3:] = 1
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask,
             "returns": torch.tensor([1.0, 0.0, 1.0, 0.0])[:, None] * mask}
    values0 = w.compute_values(batch)
    batch["old_values"] = values0 * mask
    losses = [w.train_step(batch)["vf_loss"] for _ in range(8)]
    values1 = w.compute_values(batch)
    torch.save({"values0": values0, "values1": values1, "losses": losses, "mask": mask,
                "returns": batch["returns"]}, out)
    w.shutdown()


@pytest.mark.slow
def test_critic_learns_returns(tiny_llama, tmp_path):
    out = tmp_path / "critic.pt"
    mp.spawn(_critic_child, args=(str(tiny_llama), free_port("127.0.0.1"), str(out)), nprocs=1, join=True)
    r = torch.load(out)
    assert r["values0"].shape == (4, 10)
    m = r["mask"].bool()
    err0 = (r["values0"] - r["returns"])[m].pow(2).mean()
    err1 = (r["values1"] - r["returns"])[m].pow(2).mean()
    assert r["losses"][-1] < r["losses"][0] and err1 < 0.5 * err0, (r["losses"], float(err0), float(err1))
