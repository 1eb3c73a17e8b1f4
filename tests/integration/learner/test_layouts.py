"""TP / PP / DP layouts of the Megatron learner agree with each other and with HF transformers.

Each test function spawns its processes once and runs several layouts in them
(process starts dominate the cost); children write results, the parent asserts.

Llama 3.1's RoPE scaling (rope_type llama3, which the 70B recipe's config has) through Megatron's
rope_scaling: the learner's logits and gradients equal HF transformers', and the scaling matters.

LearnerWorker.shutdown frees its model: nothing the worker holds keeps a parameter alive.

On an H200 (2026-11-28) a bf16 learner left 4.7 GiB allocated after shutdown: its Float16Module kept
the model, DDP's fp32 grad buffers and the optimizer's fp32 master weights alive. Checked here on CPU
by weak references, in one spawned process for the three optimizer / precision settings.

A non-finite gradient must not reach the weights, on either learner optimizer.

A NaN reward (a user's reward function) makes its group's advantages NaN, and so the loss and every
gradient. An optimizer stepped on them turns every weight NaN for the rest of the run, silently: torch
AdamW does, and so does Megatron's (learner.distributed_optimizer), which detects inf / NaN only through
an fp16 loss scaler and, with fp32 parameters, clips by a NaN norm (a no-op) and reports success. The
worker checks the global grad norm itself on both paths: the weights stay as they were, it raises, and
a finite batch afterwards still trains (no NaN left in the gradient buffers).

GPU-path fixes: CUDA_DEVICE_MAX_CONNECTIONS for GPU learner ranks, chat rows with unknown roles,
and the bf16 learner's weight gather in bf16 (not fp32).
"""

from __future__ import annotations
import math
import pytest
import torch
from megatron_specrl.learner.ports import free_port
from tests.helpers.learner import B, T, TOL, make_batch, hf_reference, hf_routing, complete_batch, loss_config, full_logits, _run, run_models  # noqa: F401
import json
import shutil
from pathlib import Path
from unittest import mock
from megatron_specrl.config import DataConfig, LearnerConfig
from megatron_specrl.data.datasets import DatasetError, load_file



# ---- TP / PP / DP layouts of the Megatron learner agree with each other and with HF transformers.

@pytest.fixture(scope="module")
def two_ranks(tiny_llama, tmp_path_factory):
    """The two-process layouts of tiny Llama checked against HF (run_models), then the bf16 resync gather's
    runs (_gather_child), in one spawn of two ranks: (layout results, gather dir)."""
    tmp = tmp_path_factory.mktemp("two-ranks")
    (tmp / "layouts").mkdir()
    (tmp / "gather").mkdir()
    res = run_models(2, {"llama": (tiny_llama, tmp / "layouts", [(1, 1, 2, None), (2, 1, 1, None), (1, 2, 1, 24)],
                                   False)},
                     then=(_gather_child, (str(tiny_llama), str(tmp / "gather"),
                                           [free_port("127.0.0.1") for _ in range(4)])))
    return res["llama"], tmp / "gather"


@pytest.mark.slow
def test_two_process_layouts_match_hf(two_ranks, tiny_llama):
    """DP2 (= TP1 per rank), TP2 and PP2 (dynamic batching) vs HF (run_models) and vs each other."""
    res = two_ranks[0]
    base = res["tp1pp1dp2"]
    am = make_batch(tiny_llama)["attention_mask"].bool()
    for tag in ("tp2pp1dp1", "tp1pp2dp1"):
        assert (res[tag]["logits"][am] - base["logits"][am]).abs().max() <= 1e-5
        for n, g in base["grads"].items():
            assert torch.allclose(res[tag]["grads"][n], g, atol=1e-6, rtol=1e-5), (tag, n)


@pytest.fixture(scope="module")
def four_processes(tiny_qwen2, tiny_qwen3, tiny_qwen3_moe, tmp_path_factory):
    """The four-process layouts of Qwen2, Qwen3 and Qwen3-MoE in one spawn of four ranks (each start of a
    rank costs its torch and Megatron imports), each layout checked against HF within 1e-5 (run_models);
    the tests below assert what is particular to each model. {model: {layout tag: result}}, out dirs."""
    tmp = tmp_path_factory.mktemp("four-processes")
    dirs = {name: tmp / name for name in ("qwen2", "qwen3", "moe")}
    for d in dirs.values():
        d.mkdir()
    moe = _without_aux_loss(tiny_qwen3_moe, tmp / "moe-model")
    balancing = tmp / "balancing"   # the MoE load-balancing loss's layouts, in the same ranks afterwards
    balancing.mkdir()
    batch = make_batch(tiny_qwen3_moe)
    torch.save({"batch": batch, "lp": torch.zeros(batch["input_ids"].shape)}, balancing / "ref.pt")
    then = (_load_balancing_child, ([free_port("127.0.0.1") for _ in BALANCING_LAYOUTS], BALANCING_LAYOUTS,
                                    str(tiny_qwen3_moe), str(balancing)))
    res = run_models(4, {"qwen2": (tiny_qwen2, dirs["qwen2"], [(2, 2, 1, None)], True),
                         "qwen3": (tiny_qwen3, dirs["qwen3"], [(2, 2, 1, None)], False),
                         "moe": (moe, dirs["moe"], [(2, 1, 2, None, 2), (1, 2, 2, 24, 2)], False)}, then=then)
    return res, dirs, moe, balancing


@pytest.mark.slow
def test_four_process_tp2_pp2_matches_hf(four_processes, tiny_qwen2):
    """TP2 x PP2 on Qwen2 (QKV bias, tied embeddings shared across stages); then train_step and a
    dist-checkpoint save/load that restores weights, AdamW state and RNG exactly."""
    res = four_processes[0]["qwen2"]
    from safetensors.torch import load_file
    hf = load_file(str(tiny_qwen2 / "model.safetensors"))
    weights = res["tp2pp2dp1"]["weights"]
    assert set(weights) == set(hf)
    assert all(torch.equal(weights[k], hf[k]) for k in hf)
    r = res["tp2pp2dp1"]
    assert all(math.isfinite(v) for v in r["first"].values())
    assert r["first"]["grad_norm"] > 0
    assert not torch.equal(r["saved"]["model.layers.0.self_attn.q_proj.weight"], hf["model.layers.0.self_attn.q_proj.weight"])
    assert all(torch.equal(r["saved"][k], r["restored"][k]) for k in r["saved"])
    assert r["again"] == r["second"]


@pytest.mark.slow
def test_convert_round_trip_through_tp2_pp2(tiny_llama, tmp_path):
    """HF -> dist checkpoint at TP2 x PP2 (4 ranks) -> HF at TP1 (resharded): bit-exact."""
    from safetensors.torch import load_file
    from megatron_specrl.learner.convert import convert_main
    assert convert_main(["hf-to-mcore", "--hf", str(tiny_llama), "--out", str(tmp_path / "ck"), "--tp", "2", "--pp", "2"]) == 0
    assert convert_main(["mcore-to-hf", "--ckpt", str(tmp_path / "ck"), "--out", str(tmp_path / "hf")]) == 0
    a, b = load_file(str(tiny_llama / "model.safetensors")), load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "hf" / "tokenizer.json").is_file() and (tmp_path / "hf" / "config.json").is_file()


# ---- Llama 3.1's RoPE scaling (rope_type llama3, which the 70B recipe's config has) through Megatron's

LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192, "rope_type": "llama3"}


def _with_rope_scaling(src: Path, dst: Path, scaling: dict) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["rope_scaling"] = scaling
    cfg["max_position_embeddings"] = 16384
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def one_rank(tiny_llama, tmp_path_factory):
    """The single-rank checks of this file in one spawned process (each start of a rank costs its torch and
    Megatron imports): Llama 3.1's RoPE scaling against HF (run_models), then shutdown's weak references
    and the non-finite gradient on both optimizers (_single_rank_checks). {"llama3": hf_dir, "dir": out}"""
    tmp = tmp_path_factory.mktemp("one-rank")
    hf_dir = _with_rope_scaling(tiny_llama, tmp / "llama3", LLAMA3)
    (tmp / "run").mkdir()
    nonfinite = [(free_port("127.0.0.1"), str(tmp / f"nonfinite-{d}.pt"), d) for d in (False, True)]
    run_models(1, {"llama3": (hf_dir, tmp / "run", [(1, 1, 1, None)], False)},     # logits, log-probs, grads vs HF
               then=(_single_rank_checks, (str(tiny_llama), str(tmp / "alive.json"), nonfinite)))
    return {"llama3": hf_dir, "dir": tmp}


def _single_rank_checks(rank, _world, hf_dir, alive_out, nonfinite):
    _child(rank, hf_dir, alive_out)
    for port, out, distributed in nonfinite:
        _nonfinite_child(rank, hf_dir, port, out, distributed)


@pytest.mark.slow
def test_llama3_rope_scaling_matches_hf(one_rank, tiny_llama, tmp_path):
    """The learner's logits, log-probs and gradients equal HF's within 1e-5 (in `one_rank`), and the scaling
    moves HF's logits more than that."""
    from transformers import AutoModelForCausalLM
    hf_dir = one_rank["llama3"]
    plain = _with_rope_scaling(tiny_llama, tmp_path / "plain", {"rope_type": "default"})
    ids = make_batch(hf_dir)["input_ids"]
    scaled_logits = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)(ids).logits
    plain_logits = AutoModelForCausalLM.from_pretrained(str(plain), dtype=torch.float32)(ids).logits
    # On 12 positions only the slowest frequencies are scaled, so the logits move little (5e-5 measured),
    # still 5x the 1e-5 the learner is held to; the frequencies themselves are compared exactly next.
    assert (scaled_logits - plain_logits).abs().max() > 3e-5
    assert B == ids.shape[0]


def test_megatron_rotary_frequencies_equal_hf_llama3():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import (
        RotaryEmbedding,
    )
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    cfg = AutoConfig.for_model("llama", hidden_size=128, num_attention_heads=4, max_position_embeddings=16384,
                               rope_theta=500000.0, rope_scaling=dict(LLAMA3, rope_theta=500000.0))
    hf_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    mc = RotaryEmbedding(kv_channels=32, rotary_percent=1.0, rotary_base=500000, rope_scaling=True,
                         rope_scaling_factor=8.0, use_cpu_initialization=True)
    plain = RotaryEmbedding(kv_channels=32, rotary_percent=1.0, rotary_base=500000, use_cpu_initialization=True)
    assert torch.allclose(mc.inv_freq.float(), hf_freq.float(), rtol=1e-6, atol=0)
    assert not torch.allclose(plain.inv_freq.float(), hf_freq.float(), rtol=1e-3)


def test_llama3_constants_megatron_does_not_take_are_refused():
    from transformers import AutoConfig

    from megatron_specrl.learner.model_provider import (
        check_hf_config,
        llama3_rope_factor,
    )
    cfg = AutoConfig.for_model("llama", rope_scaling=dict(LLAMA3))
    assert llama3_rope_factor(cfg) == 8.0
    check_hf_config(cfg)
    bad = AutoConfig.for_model("llama", rope_scaling=dict(LLAMA3, high_freq_factor=2.0))
    with pytest.raises(ValueError, match="high_freq_factor=2.0: Megatron fixes it at 4"):
        check_hf_config(bad)


# ---- LearnerWorker.shutdown frees its model: nothing the worker holds keeps a parameter alive.

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


def test_shutdown_leaves_no_parameter_alive(one_rank):
    assert json.loads((one_rank["dir"] / "alive.json").read_text()) == {tag: 0 for tag in SETTINGS}


# ---- A non-finite gradient must not reach the weights, on either learner optimizer.

def _nonfinite_child(rank, hf_dir, port, out, distributed):
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
def test_nan_gradients_skip_the_step_and_raise(one_rank, distributed):
    r = torch.load(one_rank["dir"] / f"nonfinite-{distributed}.pt")
    assert r["finite"] and r["unchanged"], r
    assert r["error"] is not None and "non-finite" in r["error"], r
    assert r["trained_finite"] and r["moved"], r


# ---- GPU-path fixes: CUDA_DEVICE_MAX_CONNECTIONS for GPU learner ranks, chat rows with unknown roles,

def _group_env(num_gpus_per_rank: float, env: dict | None = None) -> dict:
    """The runtime_env env_vars LearnerGroup gives its rank actors (Ray mocked out)."""
    from megatron_specrl.learner import group as group_mod
    fake_ray = mock.MagicMock()
    fake_ray.util.get_node_ip_address.return_value = "127.0.0.1"
    with mock.patch.object(group_mod, "ray", fake_ray):
        group_mod.LearnerGroup(LearnerConfig(tp=2), seed=0, num_gpus_per_rank=num_gpus_per_rank, env=env)
    opts = fake_ray.remote.return_value.options.call_args.kwargs
    return opts["runtime_env"]["env_vars"]


def test_gpu_learner_ranks_get_cuda_device_max_connections_1(monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    env = _group_env(1.0)
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert _group_env(0.5)["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"     # a GPU shared with the engines
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in _group_env(0.0)     # CPU ranks: nothing to set


def test_cuda_device_max_connections_keeps_the_users_value(monkeypatch):
    from megatron_specrl.learner.group import rank_env
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    assert _group_env(1.0)["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"    # the driver's, passed on to the ranks
    assert rank_env(1.0, {"CUDA_DEVICE_MAX_CONNECTIONS": "4"}, environ={})["CUDA_DEVICE_MAX_CONNECTIONS"] == "4"
    assert rank_env(1.0, environ={}) == {"OMP_WAIT_POLICY": "PASSIVE", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert rank_env(0.0, environ={"CUDA_DEVICE_MAX_CONNECTIONS": "8"}) == {"OMP_WAIT_POLICY": "PASSIVE"}


# --------------------------------------------------------------------------- 2. chat roles


def _chat_file(tmp_path, roles):
    p = tmp_path / "chat.jsonl"
    rows = [{"prompt": [{"role": r, "content": f"turn {i}"} for i, r in enumerate(roles)], "answer": "4"}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_unknown_chat_role_is_refused_naming_file_row_message_and_role(tmp_path):
    roles = ["system", "developer", "user", "assistant", "tool", "function", "ipython", "user"]
    (rec,) = load_file(_chat_file(tmp_path, roles), DataConfig(format="plain"))   # the standard roles load
    assert [m["role"] for m in rec.meta["messages"]] == roles and rec.prompt == "turn 7"
    for role in ["usr", "assistent", "User", ""]:
        p = _chat_file(tmp_path, ["system", role])
        with pytest.raises(DatasetError) as e:
            load_file(p, DataConfig(format="plain"))
        msg = str(e.value)
        assert f"{p}: line 1: prompt field 'prompt' message 1 has role {role!r}, expected one of system, user" in msg
        assert "\n" not in msg


# --------------------------------------------------------------------------- 3. bf16 resync gather


def _gather_child(rank, world, hf_dir, out_dir, ports):
    import torch.distributed as dist

    from megatron_specrl.learner.worker import LearnerWorker
    # the last: an fp32 learner resyncing a bf16 engine casts its shards before the gather
    runs = [("bf16_tp2", 2, 1, "bfloat16", None), ("bf16_pp2", 1, 2, "bfloat16", None),
            ("fp32_pp2", 1, 2, "float32", None), ("fp32_tp2_cast_bf16", 2, 1, "float32", torch.bfloat16)]
    for (tag, tp, pp, prec, cast), port in zip(runs, ports):
        settings = LearnerConfig(tp=tp, pp=pp, dp=1, micro_batch_size=1, loss=loss_config(), lr=1e-2,
                                 distributed_optimizer=True, precision=prec)
        w = LearnerWorker(rank, world, "127.0.0.1", port, settings, seed=1)
        w.load_hf(hf_dir)
        moved = []     # (op, dtype, bytes) of every tensor the gather puts on the wire
        real = {op: getattr(dist, op) for op in ("all_gather", "send")}

        def spy(op):
            def call(*args, **kwargs):
                t = args[1] if op == "all_gather" else args[0]
                moved.append((op, str(t.dtype), t.numel() * t.element_size()))
                return real[op](*args, **kwargs)
            return call
        with mock.patch.object(dist, "all_gather", spy("all_gather")), mock.patch.object(dist, "send", spy("send")):
            state = dict(w.iter_hf_state(dtype=cast))
        torch.save({"moved": moved, "state": state,
                    "param_dtypes": {str(p.dtype) for p in w.model.parameters()}}, f"{out_dir}/{tag}.rank{rank}.pt")
        w.shutdown()


@pytest.fixture(scope="module")
def gathered(two_ranks):
    """The bf16 gather's results, from the two ranks of `two_ranks`."""
    return lambda tag, r=0: torch.load(two_ranks[1] / f"{tag}.rank{r}.pt")


def _hf_state(hf_dir) -> dict[str, torch.Tensor]:
    from megatron_specrl.learner.hf_checkpoint import HFCheckpoint
    return dict(HFCheckpoint(hf_dir))


def test_bf16_learner_gathers_its_weights_in_bf16_and_fp32_is_unchanged(gathered, tiny_llama):
    hf = _hf_state(tiny_llama)
    for tag, op in [("bf16_tp2", "all_gather"), ("bf16_pp2", "send")]:
        res = gathered(tag)
        assert res["param_dtypes"] == {"torch.bfloat16"} and set(res["state"]) == set(hf)
        # the HF weights as the bf16 learner holds them, bit for bit, in bf16
        for name, t in res["state"].items():
            assert t.dtype == torch.bfloat16 and torch.equal(t, hf[name].to(torch.bfloat16)), (tag, name)
        # every tensor on the wire (TP all-gather; PP send to rank 0, its int64 header aside) is bf16:
        # half fp32's bytes
        wire = [m for r in (0, 1) for m in gathered(tag, r)["moved"] if m[1] != "torch.int64"]
        assert wire and {d for _, d, _ in wire} == {"torch.bfloat16"} and {o for o, _, _ in wire} == {op}, tag
    # the fp32 learner: fp32 on the wire and out, as before
    res = gathered("fp32_pp2")
    assert res["param_dtypes"] == {"torch.float32"} and set(res["state"]) == set(hf)
    for name, t in res["state"].items():
        assert t.dtype == torch.float32 and torch.equal(t, hf[name].float()), name
    sent = [m for m in gathered("fp32_pp2", 1)["moved"] if m[1] != "torch.int64"]
    assert sent and {d for _, d, _ in sent} == {"torch.float32"}
    bf16_sent = [m for m in gathered("bf16_pp2", 1)["moved"] if m[1] != "torch.int64"]
    assert 2 * sum(b for _, _, b in bf16_sent) == sum(b for _, _, b in sent) > 0   # the same tensors, half the bytes


def test_fp32_learner_casts_to_the_engine_dtype_before_the_gather(gathered, tiny_llama):
    """Resync to a bf16 engine from an fp32 learner: each shard is cast where it lives, so the TP
    all-gather (and on a GPU the copy to the host and the merge on rank 0) move bf16, and the merged
    tensors equal the fp32 weights cast after the merge, bit for bit (q/k/v and gate/up included)."""
    hf = _hf_state(tiny_llama)
    res = gathered("fp32_tp2_cast_bf16")
    assert res["param_dtypes"] == {"torch.float32"} and set(res["state"]) == set(hf)
    for name, t in res["state"].items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, hf[name].float().to(torch.bfloat16)), name
    wire = [m for r in (0, 1) for m in gathered("fp32_tp2_cast_bf16", r)["moved"]]
    assert wire and {d for _, d, _ in wire} == {"torch.bfloat16"} and {o for o, _, _ in wire} == {"all_gather"}


# ---- Qwen3 (q/k norms, head_dim from the config) and Qwen3-MoE (experts split over EP ranks) against HF.

def _hf_weights(hf_dir):
    from safetensors.torch import load_file
    return load_file(str(Path(hf_dir) / "model.safetensors"))


def _without_aux_loss(src: Path, dst: Path) -> Path:
    """HF's forward adds no load-balancing loss (output_router_logits is off); Megatron's router adds
    router_aux_loss_coef's: set it to 0 so the gradients compare the RL objective alone."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["router_aux_loss_coef"] = 0.0
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.slow
def test_qwen3_at_tp2_pp2_matches_hf_and_gathers_its_weights_exactly(four_processes, tiny_qwen3):
    res = four_processes[0]["qwen3"]   # logits, log-probs and grads within 1e-5 of HF (run_models)
    hf = _hf_weights(tiny_qwen3)
    weights = res["tp2pp2dp1"]["weights"]
    assert set(weights) == set(hf) and all(torch.equal(weights[k], hf[k]) for k in hf)


@pytest.mark.slow
def test_qwen3_moe_at_tp2_ep2_and_pp2_ep2_matches_hf_and_gathers_its_experts_exactly(four_processes):
    """Experts split over two EP ranks (4 of the 8 each), with TP2 (sequence parallel) or PP2: the
    same logits, log-probs and gradients as HF's model, and every expert gathered back bit for bit."""
    all_results, dirs, hf_dir, _ = four_processes
    res, out_dir = all_results["moe"], dirs["moe"]
    hf = _hf_weights(hf_dir)
    for tag in ("tp2pp1dp2ep2", "tp1pp2dp2ep2"):
        weights = res[tag]["weights"]
        assert set(weights) == set(hf), tag
        assert all(torch.equal(weights[k], hf[k]) for k in hf), tag
    # every router picks HF's top-2 experts for every real token (PP2 x DP2 x EP2: each rank its rows)
    batch = make_batch(hf_dir)
    want, am = hf_routing(hf_dir, batch), batch["attention_mask"].bool()
    got: dict[int, dict[int, torch.Tensor]] = {}
    for f in out_dir.glob("tp1pp2dp2ep2-routing-rank*.pt"):
        for layer, rows in torch.load(f).items():
            got.setdefault(layer, {}).update(rows)
    assert sorted(got) == sorted(want) == [0, 1]
    for layer, rows in got.items():
        assert sorted(rows) == list(range(B))
        for r, picked in rows.items():
            n = int(am[r].sum())
            assert torch.equal(picked[:n], want[layer][r, :n]), (layer, r)


@pytest.mark.slow
def test_qwen3_moe_convert_round_trip_through_tp2_ep2(tiny_qwen3_moe, tmp_path):
    """HF -> dist checkpoint at TP2 x EP2 (4 ranks) -> HF at PP2 (experts resharded): bit-exact."""
    from megatron_specrl.learner.convert import convert_main
    ck, out = tmp_path / "ck", tmp_path / "hf"
    assert convert_main(["hf-to-mcore", "--hf", str(tiny_qwen3_moe), "--out", str(ck), "--tp", "2", "--ep", "2"]) == 0
    assert convert_main(["mcore-to-hf", "--ckpt", str(ck), "--out", str(out), "--pp", "2"]) == 0
    a, b = _hf_weights(tiny_qwen3_moe), _hf_weights(out)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _load_balancing_child(rank, world, ports, layouts, hf_dir, out_dir):
    """The load-balancing loss and gradient norm of each (tp, dp, ep) layout, to balancing.pt."""
    from megatron_specrl.config import LearnerConfig
    from megatron_specrl.learner.worker import LearnerWorker
    ref = torch.load(f"{out_dir}/ref.pt")
    res = {}
    for (tp, dp, ep), port in zip(layouts, ports):
        w = LearnerWorker(rank, world, "127.0.0.1", port,
                          LearnerConfig(tp=tp, dp=dp, ep=ep, micro_batch_size=1, loss=loss_config()), seed=1)
        w.load_hf(hf_dir)
        m = w.forward_backward(complete_batch(ref["batch"], ref["lp"]))
        res[(tp, dp, ep)] = (m["moe_load_balancing_loss"], m["grad_norm"])
        w.shutdown()
    if rank == 0:
        torch.save(res, f"{out_dir}/balancing.pt")


BALANCING_LAYOUTS = [(1, 4, 2), (2, 2, 2)]   # (tp, dp, ep)


@pytest.mark.slow
def test_moe_load_balancing_loss_and_gradients_ignore_padding(four_processes, tiny_qwen3_moe):
    """With the load-balancing loss on (router_aux_loss_coef 0.001), TP2 pads every row to an even length
    for sequence parallelism and TP1 does not: the routers get the padding mask, so both give the same loss
    and gradient norm (counted in, padding moved both; the pad token's zero embedding gave large gradients).
    Run in the four ranks of `four_processes`, after its layouts."""
    batch = make_batch(tiny_qwen3_moe)
    assert (batch["attention_mask"].sum(1) % 2).any()        # some row has an odd length: TP2 pads it
    res = torch.load(four_processes[3] / "balancing.pt")
    (lb1, norm1), (lb2, norm2) = res[(1, 4, 2)], res[(2, 2, 2)]
    assert 0.5 < lb1 < 10 and abs(lb1 - lb2) < 1e-6 * lb1, res
    assert abs(norm1 - norm2) < 1e-5 * norm1, res
