"""Review of the learner's algorithm code (s19): regression tests for properties verl users rely on and
that no other test pins at the worker level.

- A mini-batch's gradient does not depend on how it is cut into microbatches (fixed sizes or token-budget
  packs), for every loss_agg_mode, with the KL, entropy and TIS terms on.
- learner.mini_batches / ppo_epochs: one train_step with mini_batches=2, ppo_epochs=2 is the same four
  optimizer steps as four single-mini-batch train_steps on the halves, in verl's order (each epoch walks
  the mini-batches in order), with the same old log-probs throughout.
"""

import pytest
import torch
import torch.multiprocessing as mp

from megatron_specrl.ports import free_port

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _batch(w, B=4, T=12):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (B, T), generator=g)
    lengths = torch.tensor([12, 7, 9, 5])
    am = (torch.arange(T)[None] < lengths[:, None]).long()
    mask = am.float().clone()
    mask[:, :3] = 0                       # the prompt
    batch = {"input_ids": ids, "attention_mask": am, "loss_mask": mask,
             "advantages": torch.randn(B, 1, generator=g) * mask}
    lp = w.compute_logprobs(batch)
    batch["rollout_logprobs"] = (lp + 0.1 * torch.randn(B, T, generator=g)) * am
    batch["old_logprobs"] = (lp + 0.05 * torch.randn(B, T, generator=g)) * am
    batch["ref_logprobs"] = (lp + 0.2 * torch.randn(B, T, generator=g)) * am
    return batch


def _child(rank, hf_dir, port, out):
    from megatron_specrl.config import LearnerConfig, LossConfig
    from megatron_specrl.learner.worker import LearnerWorker

    def loss(mode):
        return LossConfig(tis="token", agg_mode=mode, loss_scale_factor=8.0, kl_coef=0.1, entropy_coef=0.01)

    w = LearnerWorker(0, 1, "127.0.0.1", port, LearnerConfig(recompute_old_logprobs=False), seed=1)
    w.load_hf(hf_dir)
    init = {n: p.detach().clone() for n, p in w.model.named_parameters()}
    batch = _batch(w)
    split = {}
    for mode in AGG_MODES:
        grads = []
        for mbs, budget in ((4, None), (1, None), (3, None), (32, 20)):
            w.settings = LearnerConfig(micro_batch_size=mbs, max_tokens_per_microbatch=budget,
                                       recompute_old_logprobs=False, loss=loss(mode))
            metrics = w.forward_backward(batch)
            grads.append((torch.cat([p.grad.flatten().clone() for p in w._params()]), metrics["loss"]))
        split[mode] = grads

    def reset(settings):
        with torch.no_grad():
            for n, p in w.model.named_parameters():
                p.copy_(init[n])
        w.settings = settings
        w.train_steps = 0
        w._build_optimizer()

    lc = loss("seq-mean-token-mean")
    reset(LearnerConfig(micro_batch_size=1, mini_batches=2, ppo_epochs=2, recompute_old_logprobs=False, loss=lc))
    w.train_step(batch)
    one_call = {n: p.detach().clone() for n, p in w.model.named_parameters()}
    reset(LearnerConfig(micro_batch_size=2, recompute_old_logprobs=False, loss=lc))
    for _epoch in range(2):
        for half in ([0, 1], [2, 3]):
            w.train_step({k: v[half] for k, v in batch.items()})
    four_calls = {n: p.detach().clone() for n, p in w.model.named_parameters()}
    torch.save({"split": split,
                "mini_diff": max(float((one_call[n] - four_calls[n]).abs().max()) for n in init),
                "moved": max(float((one_call[n] - init[n]).abs().max()) for n in init)}, out)
    w.shutdown()


@pytest.fixture(scope="module")
def results(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("s19") / "r.pt"
    mp.spawn(_child, args=(str(tiny_llama), free_port("127.0.0.1"), str(out)), nprocs=1, join=True)
    return torch.load(out)


@pytest.mark.slow
@pytest.mark.parametrize("mode", AGG_MODES)
def test_minibatch_gradient_does_not_depend_on_the_microbatch_split(results, mode):
    (base, base_loss), *others = results["split"][mode]
    assert base.abs().max() > 1e-3
    for g, loss in others:
        assert torch.allclose(g, base, rtol=1e-4, atol=1e-5), float((g - base).abs().max())
        assert loss == pytest.approx(base_loss, rel=1e-5)


@pytest.mark.slow
def test_mini_batches_and_ppo_epochs_are_sequential_steps_on_the_halves(results):
    assert results["moved"] > 1e-5                  # the steps did train
    assert results["mini_diff"] < 1e-5, results   # float noise only (measured 6e-7; the steps move 4e-4)
