"""learner.precision=bfloat16: Megatron's bf16 mixed precision (bf16 params and compute in Float16Module,
fp32 main_grad, fp32 master weights and Adam moments in the distributed optimizer) on CPU over gloo,
against the fp32 learner; its checkpoints keep the fp32 master weights; the plan counts its bytes.

One spawn of two ranks runs every layout in turn (process starts dominate the cost); children write
results, the parent asserts.
"""

from __future__ import annotations
import math
import pytest
import torch
from tests.helpers.learner import complete_batch, full_logits, hf_reference, loss_config, make_batch
from megatron_specrl.config import ConfigError, load_config
from megatron_specrl.learner.ports import free_port

# bf16 keeps 8 significant bits: each rounding is off by up to 2^-9 ~ 2e-3 relative. The tiny model's
# logits are O(1) after 4 layers of bf16 matmuls and norms (each rounded), and the log-probs are fp32 from
# the fp32 logits (Float16Module's output cast), so a log-prob is off by about what its logits are.
# Measured (TP2 vs the fp32 TP2 learner): logits max 0.007 (|logits| <= 0.95), log-probs max 0.0047, mean
# 0.0015; the bounds leave ~4x headroom and stay far below what a real difference (a wrong weight, a
# missing cast) gives.
LOGIT_TOL, LOGPROB_TOL = 0.03, 0.02


# --------------------------------------------------------------------------- config

def test_bf16_needs_the_distributed_optimizer_and_recomputes_old_logprobs():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["learner.precision=bfloat16"])
    assert "learner.precision=bfloat16 needs learner.distributed_optimizer=true" in str(e.value)
    assert "\n" not in str(e.value)
    cfg = load_config(None, ["learner.precision=bfloat16", "learner.distributed_optimizer=true"])
    assert cfg.learner.precision == "bfloat16" and cfg.learner.recompute_old_logprobs is True
    with pytest.raises(ConfigError, match="recompute_old_logprobs=false with learner.precision=bfloat16"):
        load_config(None, ["learner.precision=bfloat16", "learner.distributed_optimizer=true",
                           "learner.recompute_old_logprobs=false"])
    default = load_config(None, [])
    assert default.learner.precision == "float32" and default.learner.recompute_old_logprobs is False


# --------------------------------------------------------------------------- plan

def test_plan_counts_bf16_bytes_and_flash_attention_on_gpus():
    from megatron_specrl.learner.model_provider import padded_vocab_size
    from megatron_specrl.plan import (ModelShape, activation_elements_per_token_layer, flash_attention,
                                      learner_memory, load_hf_config)
    from tests.helpers.paths import REPO_ROOT as ROOT
    recipe = ROOT / "examples" / "llama-3.1-70b-dapo-8node.yaml"
    fp32 = load_config(recipe, ["learner.distributed_optimizer=true"])
    bf16 = load_config(recipe, ["learner.distributed_optimizer=true", "learner.precision=bfloat16"])
    s = ModelShape.from_hf(load_hf_config(fp32.model.path))
    padded = padded_vocab_size(s.vocab, fp32.learner.tp)
    assert not flash_attention(fp32) and flash_attention(bf16)
    assert not flash_attention(load_config(recipe, ["learner.distributed_optimizer=true", "learner.precision=bfloat16",
                                                    "cluster.gpus_per_node=0"]))           # CPU: no TE flash
    a, b = learner_memory(fp32, s, padded, False), learner_memory(bf16, s, padded, True)
    n, dp = a.params, bf16.learner.dp
    assert b.params == n
    assert (a.weights, a.grads, a.optimizer) == (4 * n, 4 * n, math.ceil(8 * n / dp))
    assert (b.weights, b.grads, b.optimizer) == (2 * n, 4 * n, math.ceil(12 * n / dp))
    # activations: bf16 layer tensors (half the fp32 learner's bytes at the same flash setting), the logits
    # fp32 (Float16Module's output cast); one stage, no recompute, so activations = layers + logits
    one = ["learner.distributed_optimizer=true", "learner.pp=1", "learner.recompute=none"]
    a1 = learner_memory(load_config(recipe, one), s, padded, True)
    b1 = learner_memory(load_config(recipe, one + ["learner.precision=bfloat16"]), s, padded, True)
    logits = 2 * b1.tokens_per_microbatch * (padded // bf16.learner.tp) * 4
    assert b1.activations - logits == (a1.activations - logits) // 2 > 0
    seq = bf16.data.max_prompt_len + bf16.rollout.max_new_tokens
    assert (activation_elements_per_token_layer(s, bf16.learner.tp, seq, False)
            - activation_elements_per_token_layer(s, bf16.learner.tp, seq, True)) == s.heads * seq // bf16.learner.tp


# --------------------------------------------------------------------------- a real tiny learner

def _settings(tp, dp, precision, role="policy"):
    from megatron_specrl.config import LearnerConfig
    return LearnerConfig(tp=tp, dp=dp, micro_batch_size=1, loss=loss_config(), lr=1e-2, weight_decay=0.1,
                         grad_clip=1.0, distributed_optimizer=True, precision=precision)


def _dist_opt(w):
    return getattr(w.optimizer, "chained_optimizers", [w.optimizer])[0]


def _masters(w) -> list[torch.Tensor]:
    """This rank's fp32 master-weight shards, in the optimizer's order."""
    return [m.detach().clone() for g in _dist_opt(w).shard_fp32_from_float16_groups for m in g]


def _moments(w) -> list[torch.Tensor]:
    opt = _dist_opt(w).optimizer
    return [opt.state[m][k].detach().clone() for g in _dist_opt(w).shard_fp32_from_float16_groups for m in g
            for k in ("exp_avg", "exp_avg_sq")]


def _params_vs_masters(w) -> dict:
    """Each bf16 parameter's slice that this rank's optimizer owns against its fp32 master shard."""
    opt = _dist_opt(w)
    worst, n, rounded_away = 0.0, 0, False
    for mg, sg in zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups):
        for p, m in zip(mg, sg):
            r = opt._get_model_param_range_map(p)["param"]
            piece = p.detach().view(-1)[r.start:r.end]
            worst = max(worst, float((piece.float() - m.bfloat16().float()).abs().max()) if m.numel() else 0.0)
            rounded_away |= bool((m != m.bfloat16().float()).any())
            n += m.numel()
    return {"worst": worst, "numel": n, "fp32_bits": rounded_away,
            "master_dtypes": {str(m.dtype) for g in opt.shard_fp32_from_float16_groups for m in g}}


def _child(rank, world, hf_dir, out_dir, ports):
    from megatron_specrl.learner.worker import LearnerWorker
    ref = torch.load(f"{out_dir}/ref.pt")
    batch = complete_batch(ref["batch"], ref["lp"])
    ckpt = f"{out_dir}/ckpt_bf16"
    runs = [("fp32_tp2", 2, 1, "float32", "policy"), ("bf16_tp2", 2, 1, "bfloat16", "policy"),
            ("bf16_dp2", 1, 2, "bfloat16", "policy"), ("ref_tp2", 2, 1, "bfloat16", "reference")]
    for (tag, tp, dp, prec, role), port in zip(runs, ports):
        w = LearnerWorker(rank, world, "127.0.0.1", port, _settings(tp, dp, prec), seed=1, role=role)
        w.load_hf(hf_dir)
        res = {"param_dtypes": {str(p.dtype) for p in w.model.parameters()},
               "logits": full_logits(w, batch), "lp": w.compute_logprobs(batch)}
        if role == "policy":
            res["metrics"] = [w.train_step(batch)]
            if prec == "bfloat16":
                res["after_step"] = _params_vs_masters(w)
                res["sent"] = dict(w.iter_hf_state())          # what resync and the HF export read
            if tag == "bf16_tp2":
                w.save_checkpoint(ckpt)
                res["saved_masters"], res["saved_moments"] = _masters(w), _moments(w)
                res["metrics"].append(w.train_step(batch))
                res["uninterrupted"] = dict(w.iter_hf_state())
                w.load_hf(hf_dir)                                  # back to the HF weights, then resume
                w.load_checkpoint(ckpt)
                res["loaded_masters"], res["loaded_moments"] = _masters(w), _moments(w)
                res["loaded_vs_masters"] = _params_vs_masters(w)
                res["resumed_metrics"] = w.train_step(batch)
                res["resumed"] = dict(w.iter_hf_state())
            else:
                res["metrics"].append(w.train_step(batch))
        torch.save(res, f"{out_dir}/{tag}.rank{rank}.pt")
        w.shutdown()


@pytest.fixture(scope="module")
def runs(tiny_llama, tmp_path_factory):
    import torch.multiprocessing as mp
    tmp = tmp_path_factory.mktemp("bf16")
    batch = make_batch(tiny_llama)
    _, lp, _ = hf_reference(tiny_llama, batch, loss_config())
    torch.save({"batch": batch, "lp": lp}, tmp / "ref.pt")
    mp.spawn(_child, args=(2, str(tiny_llama), str(tmp), [free_port("127.0.0.1") for _ in range(4)]),
             nprocs=2, join=True)
    return lambda tag, r=0: torch.load(tmp / f"{tag}.rank{r}.pt")


def test_bf16_learner_scores_like_fp32_with_bf16_params_and_fp32_masters(runs):
    fp32, bf16 = runs("fp32_tp2"), runs("bf16_tp2")
    assert fp32["param_dtypes"] == {"torch.float32"} and bf16["param_dtypes"] == {"torch.bfloat16"}
    assert bf16["lp"].dtype == torch.float32
    dl = (bf16["logits"] - fp32["logits"]).abs().max()
    dlp = (bf16["lp"] - fp32["lp"]).abs().max()
    assert 0 < dl < LOGIT_TOL and 0 < dlp < LOGPROB_TOL, (dl, dlp)
    # DP2 (reduce-scatter of fp32 grads, all-gather of bf16 params over gloo) scores as TP2 does
    assert (runs("bf16_dp2")["lp"] - bf16["lp"]).abs().max() < LOGPROB_TOL
    # the frozen bf16 reference is the bf16 policy at its initial weights
    assert torch.equal(runs("ref_tp2")["lp"], bf16["lp"])
    for tag in ("bf16_tp2", "bf16_dp2"):
        for r in (0, 1):
            st = runs(tag, r)["after_step"]
            # after a step each bf16 parameter is its fp32 master weight rounded to bf16, and the masters
            # hold more than bf16's bits (they are not bf16 values)
            assert st["master_dtypes"] == {"torch.float32"} and st["numel"] > 0, (tag, r, st)
            assert st["worst"] == 0.0 and st["fp32_bits"], (tag, r, st)
    # what resync / the HF export read are the bf16 parameters (exact in bf16), merged over TP
    sent = bf16["sent"]
    assert all(torch.equal(v, v.bfloat16().float()) for v in sent.values())


def test_a_bf16_step_moves_the_loss_as_the_fp32_step_does(runs):
    fp32, bf16 = runs("fp32_tp2")["metrics"], runs("bf16_tp2")["metrics"]
    d32, d16 = fp32[1]["loss"] - fp32[0]["loss"], bf16[1]["loss"] - bf16[0]["loss"]
    assert d32 < 0 and d16 < 0, (d32, d16)
    assert math.isclose(fp32[0]["loss"], bf16[0]["loss"], rel_tol=0.05), (fp32[0]["loss"], bf16[0]["loss"])
    assert math.isclose(fp32[0]["grad_norm"], bf16[0]["grad_norm"], rel_tol=0.05)


def test_bf16_checkpoint_resumes_the_fp32_master_weights_and_moments(runs):
    for r in (0, 1):
        res = runs("bf16_tp2", r)
        saved, loaded = res["saved_masters"], res["loaded_masters"]
        assert len(saved) == len(loaded) > 0
        assert all(a.dtype == torch.float32 and torch.equal(a, b) for a, b in zip(saved, loaded))
        assert any((a != a.bfloat16().float()).any() for a in saved)   # not the bf16-rounded ones
        assert all(torch.equal(a, b) for a, b in zip(res["saved_moments"], res["loaded_moments"]))
        assert res["loaded_vs_masters"]["worst"] == 0.0
    res = runs("bf16_tp2")
    # the resumed step is the uninterrupted one
    assert res["resumed_metrics"]["loss"] == res["metrics"][1]["loss"]
    assert all(torch.equal(res["resumed"][k], v) for k, v in res["uninterrupted"].items())
