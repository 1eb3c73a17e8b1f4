"""verl's engine keys (rollout.enforce_eager, cudagraph_capture_sizes, max_num_seqs,
max_num_batched_tokens, engine_kwargs.vllm / .sglang) reach vLLM and SGLang as their arguments.

Before session 24 every vLLM engine ran eager (enforce_eager=True hard-coded), on GPUs too: no CUDA
graphs, a kernel launch per op every decode step. The GPU arguments are built here with the engine's
pure argument builder (vllm_engine.llm_args), since no GPU is on this machine."""

import sys
import types

import pytest

from megatron_specrl.config import ConfigError, RolloutConfig, load_config, resolve_recipe
from megatron_specrl.engines import factory
from megatron_specrl.engines.vllm_engine import llm_args, vllm_engine_arg_names


def _args(tmp_path, on_cpu, **kw):
    base = dict(on_cpu=on_cpu, seed=0, max_model_len=256, kv_cache_gb=0.5, gpu_memory_utilization=0.6,
                tensor_parallel_size=1, block_size=32 if on_cpu else 16, dtype="bfloat16",
                enable_prefix_caching=True, enforce_eager=None, cudagraph_capture_sizes=None, max_num_seqs=None,
                max_num_batched_tokens=None, logprobs_mode="processed_logprobs", draft="tree", draft_tokens=16)
    base.update(kw)
    return llm_args(str(tmp_path), **base)


def test_gpu_engines_run_cuda_graphs_unless_told_and_cpu_engines_run_eager(tmp_path):
    gpu = _args(tmp_path, on_cpu=False)
    assert gpu["enforce_eager"] is False                    # verl's enforce_eager: false
    assert "kv_cache_memory_bytes" not in gpu and "enable_chunked_prefill" not in gpu
    assert "max_num_seqs" not in gpu and "max_num_batched_tokens" not in gpu   # vLLM's own defaults
    assert gpu["speculative_config"]["method"] == "custom_class" and gpu["async_scheduling"] is False
    assert _args(tmp_path, on_cpu=False, enforce_eager=True)["enforce_eager"] is True
    cpu = _args(tmp_path, on_cpu=True)
    assert cpu["enforce_eager"] is True                     # no inductor compile at start
    assert cpu["enable_chunked_prefill"] is False and cpu["max_num_batched_tokens"] == 8192
    assert _args(tmp_path, on_cpu=True, enforce_eager=False)["enforce_eager"] is False   # asked: honoured


def test_capture_sizes_scheduler_limits_and_engine_kwargs_reach_vllm(tmp_path):
    kw = _args(tmp_path, on_cpu=False, cudagraph_capture_sizes=[8, 1, 2, 8], max_num_seqs=256,
               max_num_batched_tokens=4096,
               engine_args={"compilation_config": {"cudagraph_mode": "PIECEWISE"}, "max_logprobs": 5},
               known_args={"compilation_config", "max_logprobs"})
    assert kw["compilation_config"] == {"cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [1, 2, 8]}
    assert kw["max_num_seqs"] == 256 and kw["max_num_batched_tokens"] == 4096 and kw["max_logprobs"] == 5
    with pytest.raises(ValueError, match="needs CUDA graphs"):
        _args(tmp_path, on_cpu=False, enforce_eager=True, cudagraph_capture_sizes=[1])
    # a GPU recipe's capture sizes tried on a CPU (enforce_eager unset: eager there) start, capturing nothing
    assert "compilation_config" not in _args(tmp_path, on_cpu=True, cudagraph_capture_sizes=[1, 2])
    # a CPU engine prefills a whole sequence a step (no chunked prefill): a smaller budget is refused
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=100: .* at least the engine's max_model_len, 273"):
        _args(tmp_path, on_cpu=True, max_num_batched_tokens=100)
    assert _args(tmp_path, on_cpu=True, max_num_batched_tokens=300)["max_num_batched_tokens"] == 300


def test_engine_kwargs_are_checked_against_vllms_engine_args_before_it_starts(tmp_path):
    names = vllm_engine_arg_names()
    assert {"disable_log_stats", "max_logprobs", "compilation_config"} <= names
    assert _args(tmp_path, on_cpu=True, engine_args={"max_logprobs": 3})["max_logprobs"] == 3
    with pytest.raises(ValueError, match=r"^rollout\.engine_kwargs\.vllm\.max_num_seq: not an engine argument"):
        _args(tmp_path, on_cpu=True, engine_args={"max_num_seq": 3})        # a typo: vLLM never sees it
    with pytest.raises(ValueError, match=r"^rollout\.engine_kwargs\.vllm\.seed: set through trainer\.seed"):
        _args(tmp_path, on_cpu=True, engine_args={"seed": 3})


def test_config_refuses_in_one_line_what_the_engines_could_not_honour():
    recipe = resolve_recipe("tiny-cpu-grpo")
    bad = {
        ("rollout.engine_kwargs.vllm.max_model_len=4",): "rollout.engine_kwargs.vllm.max_model_len: set through "
                                                         "rollout.max_model_len",
        ("rollout.engine_kwargs.sglang.tp_size=2",): "rollout.engine_kwargs.sglang.tp_size: set through "
                                                     "rollout.engine_tp",
        ("rollout.enforce_eager=true", "rollout.cudagraph_capture_sizes=[1,2]"): "needs CUDA graphs",
        ("rollout.cudagraph_capture_sizes=[0]",): "expected a non-empty list of batch sizes >= 1",
        ("rollout.engine=sglang", "rollout.max_num_batched_tokens=4096"): "engine_kwargs.sglang.chunked_prefill_size",
        ("rollout.max_num_seqs=0",): "rollout.max_num_seqs",
    }
    for overrides, message in bad.items():
        with pytest.raises(ConfigError) as e:
            load_config(recipe, list(overrides))
        assert message in str(e.value) and "\n" not in str(e.value), (overrides, str(e.value))
    cfg = load_config(recipe, ["rollout.max_num_seqs=64", "rollout.engine_kwargs.vllm.disable_log_stats=true"])
    assert cfg.rollout.max_num_seqs == 64 and cfg.rollout.engine_kwargs.vllm == {"disable_log_stats": True}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_factory_hands_each_engine_its_own_engine_kwargs(monkeypatch, tmp_path, engine):
    if engine == "sglang":   # not installable here; the factory only needs the class
        fake = types.ModuleType("megatron_specrl.engines.sglang_engine")
        fake.SGLangEngine = object
        monkeypatch.setitem(sys.modules, "megatron_specrl.engines.sglang_engine", fake)
    cfg = RolloutConfig(engine=engine, enforce_eager=False, cudagraph_capture_sizes=[4], max_num_seqs=32,
                        engine_kwargs={"vllm": {"disable_log_stats": True}, "sglang": {"chunked_prefill_size": 1024}})
    _, kw = factory.engine_kwargs(cfg, str(tmp_path), tmp_path, 0, 0)
    assert (kw["enforce_eager"], kw["cudagraph_capture_sizes"], kw["max_num_seqs"]) == (False, [4], 32)
    assert kw["engine_args"] == ({"disable_log_stats": True} if engine == "vllm" else {"chunked_prefill_size": 1024})
    assert ("max_num_batched_tokens" in kw) == (engine == "vllm")
    assert ("seed_requests" in kw) == (engine == "vllm")      # SGLang keeps its sampling_seed


def test_sglang_gets_the_keys_in_its_own_names():
    from test_sglang_engine import FakeSGLang

    from megatron_specrl.engines.sglang_engine import SGLangEngine

    def server_args(**kw):
        return SGLangEngine("m", engine=FakeSGLang(), use_ban_processor=False, log_dir="/tmp/specrl-sgl-test",
                            **kw).server_args

    plain = server_args()
    assert "disable_cuda_graph" not in plain and "cuda_graph_bs" not in plain   # SGLang's CUDA graphs
    args = server_args(enforce_eager=None, cudagraph_capture_sizes=[16, 1, 4], max_num_seqs=128,
                       engine_args={"chunked_prefill_size": 2048})
    assert args["cuda_graph_bs"] == [1, 4, 16] and args["max_running_requests"] == 128
    assert args["chunked_prefill_size"] == 2048
    assert server_args(enforce_eager=True)["disable_cuda_graph"] is True
    with pytest.raises(ValueError, match=r"^rollout\.engine_kwargs\.sglang\.random_seed: set through trainer\.seed"):
        server_args(engine_args={"random_seed": 1})


@pytest.mark.parametrize("gpu", [False, True])
def test_a_gpu_engine_builds_vllm_with_cuda_graphs_and_unseeded_requests(monkeypatch, tmp_path, gpu):
    """The engine itself (vLLM's LLM replaced by a recorder): on a GPU, CUDA graphs and generate
    requests without per-request seeds (vLLM's CUDA sampler loops over seeded requests one kernel each,
    every step); on CPU, eager and seeded (resume replays the same samples). Asked-for values win."""
    import torch
    import vllm

    from patches.vllm_engine_patches import ENV
    from megatron_specrl.engines.protocol import GenerateRequest, SamplingSettings
    from megatron_specrl.engines.vllm_engine import VLLMEngine

    built = []

    class RecordingLLM:
        def __init__(self, **kwargs):
            built.append(kwargs)

    monkeypatch.setattr(vllm, "LLM", RecordingLLM)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    monkeypatch.setenv(ENV, "0")
    eng = VLLMEngine(str(tmp_path), name="rec", log_dir=str(tmp_path), max_num_seqs=64,
                     engine_args={"max_logprobs": 5})
    assert built[-1]["enforce_eager"] is (not gpu) and built[-1]["max_num_seqs"] == 64
    assert built[-1]["max_logprobs"] == 5 and built[-1]["block_size"] == (16 if gpu else 32)
    req = GenerateRequest([3, 4, 5], 4, seed=11)
    assert eng._sampling_params(req, SamplingSettings()).seed == (None if gpu else 11)
    eng = VLLMEngine(str(tmp_path), name="rec", log_dir=str(tmp_path), seed_requests=True, enforce_eager=True)
    assert eng._sampling_params(req, SamplingSettings()).seed == 11 and built[-1]["enforce_eager"] is True


class _OnGPU:
    """A bucket tensor as a broadcast receiver hands it over on a GPU (none here): device cuda:0."""
    device = __import__("torch").device("cuda", 0)

    def __init__(self, value):
        self.value = value

    def detach(self):
        return self

    def cpu(self):
        return self.value


@pytest.mark.parametrize("tp", [1, 2])
def test_an_engine_with_tp_workers_hands_them_cpu_tensors(monkeypatch, tp):
    """With engine_tp > 1 vLLM's workers are processes: a CUDA tensor in collective_rpc's arguments
    would be rebuilt on cuda:0 in every worker. The engine moves such tensors to the host first
    (the shared-memory queue passes CPU tensors as raw buffers); one worker in-process takes them as
    they are."""
    import threading

    import torch

    from megatron_specrl.engines.vllm_engine import VLLMEngine

    sent = []

    class LLM:
        def collective_rpc(self, fn, kwargs):
            sent.append(kwargs["named_tensors"])
            return [len(kwargs["named_tensors"])]

    eng = VLLMEngine.__new__(VLLMEngine)
    eng.name, eng.tensor_parallel_size, eng.llm = "e", tp, LLM()
    eng._lock, eng._version, eng._pending_version = threading.Lock(), 0, None
    eng._log = __import__("logging").getLogger("test")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    on_host = torch.ones(3)
    eng.update_weights([("a", _OnGPU(torch.zeros(2))), ("b", on_host)], version=1)
    (a, got_a), (b, got_b) = sent[0]
    assert got_b.device.type == "cpu" and torch.equal(got_b, on_host)
    assert isinstance(got_a, torch.Tensor) if tp > 1 else isinstance(got_a, _OnGPU)
