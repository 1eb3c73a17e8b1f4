"""Review fixes (s23): CUDA_DEVICE_MAX_CONNECTIONS for GPU learner ranks, chat rows with unknown roles,
and the bf16 learner's weight gather in bf16 (not fp32)."""

from __future__ import annotations

import json
from unittest import mock

import pytest
import torch

from megatron_specrl.config import DataConfig, LearnerConfig
from megatron_specrl.data.datasets import DatasetError, load_file
from megatron_specrl.ports import free_port

# --------------------------------------------------------------------------- 1. learner ranks' env


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
    from test_learner_layouts import loss_config
    # the last: an fp32 learner resyncing a bf16 engine casts its shards before the gather (session 24)
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
def gathered(tiny_llama, tmp_path_factory):
    import torch.multiprocessing as mp
    tmp = tmp_path_factory.mktemp("gather")
    mp.spawn(_gather_child, args=(2, str(tiny_llama), str(tmp), [free_port("127.0.0.1") for _ in range(4)]),
             nprocs=2, join=True)
    return lambda tag, r=0: torch.load(tmp / f"{tag}.rank{r}.pt")


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
